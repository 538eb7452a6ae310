"""The control API (capture/control/api.py) described as OpenAPI 3.1, served at /openapi.json:
the ``POST /sessions`` and ``POST /rollouts`` bodies are their pydantic models' JSON Schema, the
rest is the table of operations below.

``tests/unit/control/test_openapi.py`` checks this document against the routes the API serves
(the same methods and paths, the token wanted by the same ones) and the models.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from pydantic import BaseModel

from capture.control.media import ARROW_STREAM
from capture.control.models import SessionBody
from capture.rollouts.spec import RolloutBody

# The models served as components (their nested models beside them): name -> model.
MODELS: dict[str, type[BaseModel]] = {"SessionBody": SessionBody, "RolloutBody": RolloutBody}
REF = "#/components/schemas/{model}"
# The routes anyone may call; every other wants 'Authorization: Bearer TOKEN'.
OPEN_PATHS = frozenset({"/healthz", "/ready", "/ui/"})

REWARD = {
    "oneOf": [
        {"type": "number"},
        {"type": "object", "additionalProperties": {"type": "number"}},
    ],
    "description": "one number for every thread row, or one per thread id",
}
ROWS = {
    "description": "the session's thread rows (docs/SHARDS.md) with its summary; an Arrow "
    "IPC stream for Accept: application/vnd.apache.arrow.stream",
    "content": {
        "application/json": {"schema": {"type": "object"}},
        ARROW_STREAM: {"schema": {"type": "string", "format": "binary"}},
    },
}


def _said(description: str) -> dict[str, str]:
    return {"description": description}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _fields(props: dict[str, Any]) -> dict[str, Any]:
    """A request body of the fields ``props`` (the bodies without a model of their own)."""
    return _body({"type": "object", "properties": props})


def _model(name: str) -> dict[str, Any]:
    return _body({"$ref": REF.format(model=name)})


# path -> method -> operation, without its path parameters and security (added from the path).
OPERATIONS: dict[str, dict[str, dict[str, Any]]] = {
    "/sessions": {
        "post": {
            "summary": "open a session",
            "requestBody": _model("SessionBody"),
            "responses": {"200": _said("{id, env, base_urls, limits}")},
        },
        "get": {
            "summary": "live sessions with their call and token counts",
            "responses": {"200": _said("{sessions: [...]}")},
        },
    },
    "/sessions/{id}": {
        "get": {
            "summary": "the session's rows so far, late rewards joined",
            "responses": {"200": ROWS, "404": _said("unknown session")},
        }
    },
    "/sessions/{id}/close": {
        "post": {
            "summary": "close the session, write its rows with reward and metadata",
            "requestBody": _fields(
                {
                    "reward": REWARD,
                    "reward_auxiliary": {
                        "type": "boolean",
                        "default": False,
                        "description": "one number is set on the main and subagent rows; "
                        "true: on the auxiliary rows (titles, routers, summaries) too",
                    },
                }
            ),
            "responses": {"200": ROWS, "404": _said("unknown session")},
        }
    },
    "/sessions/{id}/reward": {
        "post": {
            "summary": "a late reward for a closed session",
            "requestBody": _fields({"reward": REWARD}),
            "responses": {"200": _said("written")},
        }
    },
    "/sessions/{id}/advantage": {
        "post": {
            "summary": "the trainer's own advantage for a session, for the viewer",
            "requestBody": _fields(
                {
                    "advantage": {"type": "number", "description": "as the trainer used it"},
                    "step": {"type": "integer", "description": "the trainer step"},
                    "step_s": {
                        "type": "number",
                        "description": "the trainer's own time for the step, in seconds",
                    },
                }
            ),
            "responses": {"200": _said("written"), "404": _said("unknown session")},
        }
    },
    "/rollouts": {
        "post": {
            "summary": "run n real CLI agents on a task, score them, return their rows",
            "requestBody": _model("RolloutBody"),
            "responses": {
                "200": _said("status, finish_reason, reward, metrics, rows of each"),
                "202": _said("started (wait: false)"),
                "429": _said("too many agents running; see Retry-After"),
            },
        },
        "get": {
            "summary": "rollouts of this process",
            "responses": {"200": _said("{rollouts: [...]}")},
        },
    },
    "/rollouts/{id}": {
        "get": {
            "summary": "one rollout, while it runs too",
            "responses": {"200": _said("its summary")},
        },
        "delete": {
            "summary": "stop it: its agents end, their rows are kept (cancelled)",
            "responses": {"200": _said("its summary")},
        },
    },
    "/flush": {
        "post": {
            "summary": "write sessions' shards now (?session=ID: one)",
            "responses": {"200": _said("{written: [paths]}")},
        }
    },
    "/replicas": {
        "get": {
            "summary": "the policy servers of agenttap_policy_url: state (serving, loading, "
            "paused, sleeping, unverified, failing), why, load, weights",
            "responses": {"200": _said("{replicas: [...], max_inflight, queue}")},
        },
        "post": {
            "summary": "add a policy server (it must complete a 1-token generation)",
            "requestBody": _fields({"url": {"type": "string"}}),
            "responses": {
                "200": _said("the replicas now"),
                "400": _said("not one policy URL, or it does not answer"),
            },
        },
        "delete": {
            "summary": "remove a policy server (?url=URL); running generations finish",
            "responses": {"200": _said("the replicas now")},
        },
    },
    "/policy/weights": {
        "post": {
            "summary": "every policy replica serves the weights in path (a folder "
            "save_pretrained wrote; or lora: a PEFT adapter's), labelled version, each checked "
            "against the trainer's probe; in-flight calls go on under them",
            "requestBody": _fields(
                {
                    "path": {"type": "string"},
                    "lora": {"type": "string"},
                    "version": {"type": "string"},
                    "probe": {
                        "type": "object",
                        "properties": {
                            "ids": {"type": "array", "items": {"type": "integer"}},
                            "logprobs": {"type": "array"},
                        },
                    },
                }
            ),
            "responses": {
                "200": _said(
                    "{version, checked, replicas: [{url, ok, version, seconds, checked, max_diff}]}"
                ),
                "400": _said("no such folder, no safetensors, a bad version"),
                "502": _said(
                    "a replica did not load them or failed the probe (error.replicas); it is "
                    "out of rotation"
                ),
            },
        }
    },
    "/policy/version": {
        "get": {
            "summary": "the weights served now: version, index (updates before it)",
            "responses": {"200": _said("{version, index, updated_at, versions}")},
        },
        "post": {
            "summary": "weights a trainer pushed to vLLM itself: calls from now on are labelled "
            "version",
            "requestBody": _fields({"version": {"type": "string"}, "probe": {"type": "object"}}),
            "responses": {
                "200": _said("{version, checked, replicas}"),
                "502": _said("a replica failed the probe (error.replicas)"),
            },
        },
    },
    "/ui/": {
        "get": {
            "summary": "the trajectory viewer (open it as /ui/#token=TOKEN)",
            "responses": {"200": _said("the page")},
        }
    },
    "/metrics": {
        "get": {
            "summary": "Prometheus metrics (names start with agenttap_)",
            "responses": {"200": _said("text exposition format")},
        }
    },
    "/openapi.json": {
        "get": {
            "summary": "this document",
            "responses": {"200": _said("OpenAPI 3.1")},
        }
    },
    "/healthz": {"get": {"responses": {"200": _said("alive")}}},
    "/ready": {
        "get": {
            "summary": "readiness; without the token {ready} alone, with it the model and each "
            "server's url and state",
            "responses": {
                "200": _said("tokenizer loaded, policy answers"),
                "503": _said("not ready (the reason with the token)"),
            },
        }
    },
}


def model_schemas() -> dict[str, Any]:
    """The models' JSON Schemas as OpenAPI components: each model and the models it nests."""
    schemas: dict[str, Any] = {}
    for name, model in MODELS.items():
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[name] = schema
    return schemas


def _operation(path: str, operation: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(operation)
    names = re.findall(r"{(\w+)}", path)
    if names:
        out["parameters"] = [
            {"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names
        ]
    if path not in OPEN_PATHS:
        out["security"] = [{"bearer": []}]
    return out


def openapi_spec(server: str) -> dict[str, Any]:
    """The control API as OpenAPI 3.1 (served at /openapi.json)."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "agenttap control API", "version": "1"},
        "servers": [{"url": server}],
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": model_schemas(),
        },
        "paths": {
            path: {method: _operation(path, op) for method, op in methods.items()}
            for path, methods in OPERATIONS.items()
        },
    }
