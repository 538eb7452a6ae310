"""The control API (capture/control/api.py) described as OpenAPI 3.1, served at /openapi.json."""

from __future__ import annotations

from typing import Any

ARROW_STREAM = "application/vnd.apache.arrow.stream"


def openapi_spec(server: str) -> dict[str, Any]:
    """The control API as OpenAPI 3.1 (served at /openapi.json)."""
    reward = {
        "oneOf": [
            {"type": "number"},
            {"type": "object", "additionalProperties": {"type": "number"}},
        ],
        "description": "one number for every thread row, or one per thread id",
    }
    limits = {
        "type": "object",
        "properties": {
            "max_calls": {"type": "integer", "minimum": 1},
            "max_tokens": {"type": "integer", "minimum": 1, "description": "sampled tokens"},
            "deadline_s": {"type": "number", "exclusiveMinimum": 0},
        },
    }
    rows = {
        "description": "the session's thread rows (docs/SHARDS.md) with its summary; an Arrow "
        "IPC stream for Accept: application/vnd.apache.arrow.stream",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            ARROW_STREAM: {"schema": {"type": "string", "format": "binary"}},
        },
    }
    sid = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
    secured: list[dict[str, list[str]]] = [{"bearer": []}]

    def body(props: dict[str, Any]) -> dict[str, Any]:
        return {
            "content": {"application/json": {"schema": {"type": "object", "properties": props}}}
        }

    return {
        "openapi": "3.1.0",
        "info": {"title": "agenttap control API", "version": "1"},
        "servers": [{"url": server}],
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/sessions": {
                "post": {
                    "summary": "open a session",
                    "security": secured,
                    "requestBody": body(
                        {"id": {"type": "string"}, "metadata": {"type": "object"}, "limits": limits}
                    ),
                    "responses": {"200": {"description": "{id, env, base_urls, limits}"}},
                },
                "get": {
                    "summary": "live sessions with their call and token counts",
                    "security": secured,
                    "responses": {"200": {"description": "{sessions: [...]}"}},
                },
            },
            "/sessions/{id}": {
                "get": {
                    "summary": "the session's rows so far, late rewards joined",
                    "security": secured,
                    "parameters": [sid],
                    "responses": {"200": rows, "404": {"description": "unknown session"}},
                }
            },
            "/sessions/{id}/close": {
                "post": {
                    "summary": "close the session, write its rows with reward and metadata",
                    "security": secured,
                    "parameters": [sid],
                    "requestBody": body(
                        {
                            "reward": reward,
                            "reward_auxiliary": {
                                "type": "boolean",
                                "default": False,
                                "description": "one number is set on the main and subagent rows; "
                                "true: on the auxiliary rows (titles, routers, summaries) too",
                            },
                        }
                    ),
                    "responses": {"200": rows, "404": {"description": "unknown session"}},
                }
            },
            "/sessions/{id}/reward": {
                "post": {
                    "summary": "a late reward for a closed session",
                    "security": secured,
                    "parameters": [sid],
                    "requestBody": body({"reward": reward}),
                    "responses": {"200": {"description": "written"}},
                }
            },
            "/rollouts": {
                "post": {
                    "summary": "run n real CLI agents on a task, score them, return their rows",
                    "security": secured,
                    "requestBody": body(
                        {
                            "agent": {
                                "oneOf": [
                                    {
                                        "type": "string",
                                        "enum": [
                                            "claude-code",
                                            "codex",
                                            "gemini",
                                            "opencode",
                                            "mini-swe-agent",
                                            "openhands",
                                            "terminus-2",
                                        ],
                                    },
                                    {
                                        "type": "object",
                                        "properties": {
                                            "command": {
                                                "type": "array",
                                                "items": {"type": "string"},
                                            }
                                        },
                                    },
                                ]
                            },
                            "prompt": {"type": "string"},
                            "workdir": {"type": "string"},
                            "n": {"type": "integer", "minimum": 1},
                            "limits": limits,
                            "metadata": {"type": "object"},
                            "verifier": {
                                "type": "object",
                                "description": "one of command and pytest",
                                "properties": {
                                    "command": {"type": "array", "items": {"type": "string"}},
                                    "pytest": {
                                        "type": "array",
                                        "items": {"type": "string"},
                                        "description": "node ids: the reward is the share "
                                        "that passed (a JUnit report, on the seed)",
                                    },
                                    "python": {"type": "string"},
                                    "keep": {
                                        "type": "array",
                                        "items": {"type": "string"},
                                        "description": "globs of the agent's files graded "
                                        "on a fresh copy of the seed workdir",
                                    },
                                    "restore": {
                                        "type": "array",
                                        "items": {"type": "string"},
                                        "description": "relative paths put back from the "
                                        "workdir into the agent's copy before scoring",
                                    },
                                    "on_error": {"type": "string", "enum": ["skip", "score"]},
                                    "reward_range": {
                                        "type": "array",
                                        "items": {"type": "number"},
                                        "minItems": 2,
                                        "maxItems": 2,
                                        "description": "[lo, hi], default [0, 1]",
                                    },
                                },
                            },
                            "sandbox": {
                                "type": "string",
                                "enum": ["bwrap", "none"],
                                "description": "how the agent and verifier run; default: "
                                "agenttap_sandbox (bwrap)",
                            },
                            "id": {"type": "string"},
                            "timeout_s": {"type": "number"},
                            "wait": {"type": "boolean"},
                            "rows": {
                                "type": "boolean",
                                "description": "false: each rollout's summary without its rows",
                            },
                        }
                    ),
                    "responses": {
                        "200": {
                            "description": "status, finish_reason, reward, metrics, rows of each"
                        },
                        "202": {"description": "started (wait: false)"},
                        "429": {"description": "too many agents running; see Retry-After"},
                    },
                },
                "get": {
                    "summary": "rollouts of this process",
                    "security": secured,
                    "responses": {"200": {"description": "{rollouts: [...]}"}},
                },
            },
            "/rollouts/{id}": {
                "get": {
                    "summary": "one rollout, while it runs too",
                    "security": secured,
                    "parameters": [sid],
                    "responses": {"200": {"description": "its summary"}},
                },
                "delete": {
                    "summary": "stop it: its agents end, their rows are kept (cancelled)",
                    "security": secured,
                    "parameters": [sid],
                    "responses": {"200": {"description": "its summary"}},
                },
            },
            "/flush": {
                "post": {
                    "summary": "write sessions' shards now (?session=ID: one)",
                    "security": secured,
                    "responses": {"200": {"description": "{written: [paths]}"}},
                }
            },
            "/replicas": {
                "get": {
                    "summary": "the policy servers of agenttap_policy_url: state (serving, "
                    "loading, paused, sleeping, unverified, failing), why, load, weights",
                    "security": secured,
                    "responses": {"200": {"description": "{replicas: [...], max_inflight, queue}"}},
                },
                "post": {
                    "summary": "add a policy server (it must complete a 1-token generation)",
                    "security": secured,
                    "requestBody": body({"url": {"type": "string"}}),
                    "responses": {
                        "200": {"description": "the replicas now"},
                        "400": {"description": "not one policy URL, or it does not answer"},
                    },
                },
                "delete": {
                    "summary": "remove a policy server (?url=URL); running generations finish",
                    "security": secured,
                    "responses": {"200": {"description": "the replicas now"}},
                },
            },
            "/policy/weights": {
                "post": {
                    "summary": "every policy replica serves the weights in path (a folder "
                    "save_pretrained wrote; or lora: a PEFT adapter's), labelled version, each "
                    "checked against the trainer's probe; in-flight calls go on under them",
                    "security": secured,
                    "requestBody": body(
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
                        "200": {
                            "description": "{version, checked, replicas: [{url, ok, version, "
                            "seconds, checked, max_diff}]}"
                        },
                        "400": {"description": "no such folder, no safetensors, a bad version"},
                        "502": {
                            "description": "a replica did not load them or failed the probe "
                            "(error.replicas); it is out of rotation"
                        },
                    },
                }
            },
            "/policy/version": {
                "get": {
                    "summary": "the weights served now: version, index (updates before it)",
                    "security": secured,
                    "responses": {"200": {"description": "{version, index, updated_at, versions}"}},
                },
                "post": {
                    "summary": "weights a trainer pushed to vLLM itself: calls from now on are "
                    "labelled version",
                    "security": secured,
                    "requestBody": body(
                        {"version": {"type": "string"}, "probe": {"type": "object"}}
                    ),
                    "responses": {
                        "200": {"description": "{version, checked, replicas}"},
                        "502": {"description": "a replica failed the probe (error.replicas)"},
                    },
                },
            },
            "/ui/": {
                "get": {
                    "summary": "the trajectory viewer (open it as /ui/#token=TOKEN)",
                    "responses": {"200": {"description": "the page"}},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics (names start with agenttap_)",
                    "security": secured,
                    "responses": {"200": {"description": "text exposition format"}},
                }
            },
            "/healthz": {"get": {"responses": {"200": {"description": "alive"}}}},
            "/ready": {
                "get": {
                    "summary": "readiness; without the token {ready} alone, with it the model "
                    "and each server's url and state",
                    "responses": {
                        "200": {"description": "tokenizer loaded, policy answers"},
                        "503": {"description": "not ready (the reason with the token)"},
                    },
                }
            },
        },
    }
