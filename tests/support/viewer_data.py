"""Shards for the viewer's tests, written with the proxy's own writer and schemas.

``agent``: an agent session of three calls (a tool call, its result, then a call whose prompt the
scaffold rewrote: a reminder injected into the history), with a dead retry branch and a spawned
sub-agent row; metadata and reward set as a trainer's close sets them.
``long``: one row of 100,000 tokens over three calls.
``long prompt``: one call whose sampled (trained) tokens sit 12,000 prompt tokens in.
``hostile``: ids and text that are HTML and address syntax (``<img onerror=...>``, ``&row=``,
``#``): the page must show them as text and route by them exactly.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from capture.storage.shards import THREAD_SCHEMA, TURN_SCHEMA, write_rows

TOOL_CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/app.py"}}\n</tool_call>'
REMINDER = "<system-reminder>Keep answers short.</system-reminder>"


def _turn(
    sid: str, request_id: str, index: int, prompt: list[int], completion: list[int], text: str
) -> dict[str, Any]:
    rng = random.Random(index)
    return {
        "schema_version": 1,
        "session_id": sid,
        "thread_id": "t-" + request_id,
        "request_id": request_id,
        "turn_index": index,
        "protocol": "openai.chat",
        "requested_model": "gpt-5",
        "policy_model": "policy",
        "backend": "http://127.0.0.1:8000",
        "user_agent": "OpenAI/Python",
        "prompt_ids": prompt,
        "completion_ids": completion,
        "completion_logprobs": [-rng.random() * 3 for _ in completion],
        "completion_text": text,
        "finish_reason": "stop",
        "response_finish_reason": "tool_calls" if "<tool_call>" in text else "stop",
        "stream": True,
        "started_at": 1_700_000_000.0 + index,
        "latency_s": 0.25 + index,
        "metadata": json.dumps({"assembly": "extend" if index else "new"}),
        "weight_versions": [],
    }


def _row(
    sid: str,
    thread_id: str,
    calls: list[dict[str, Any]],
    trained: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    """A thread row over ``calls`` (each extends the previous): prompt tokens 0, sampled 1."""
    last = calls[-1]
    ids = list(last["prompt_ids"]) + list(last["completion_ids"])
    mask = [0] * len(ids)
    prov = [0] * len(ids)
    lps = [0.0] * len(ids)
    turns = []
    for call in calls:
        start = len(call["prompt_ids"])
        end = start + len(call["completion_ids"])
        for k, pos in enumerate(range(start, end)):
            prov[pos] = 1
            mask[pos] = int(trained)
            lps[pos] = call["completion_logprobs"][k]
        turns.append(
            {
                "request_id": call["request_id"],
                "turn_index": call["turn_index"],
                "start": start,
                "end": end,
                "finish_reason": call["finish_reason"],
                "latency_s": call["latency_s"],
                "backend": call["backend"],
                "dropped": False,
                "status": "trained" if trained else "context",
                "trained_in": thread_id if trained else None,
            }
        )
    row = {
        "schema_version": 2,
        "session_id": sid,
        "thread_id": thread_id,
        "parent_thread_id": None,
        "parent_relation": None,
        "parent_tool_call_id": None,
        "dead": False,
        "dead_reason": None,
        "superseded_by": None,
        "input_ids": ids,
        "loss_mask": mask,
        "logprobs": lps,
        "provenance": prov,
        "turns": turns,
        "num_turns": len(calls) if trained else 0,
        "trained_request_ids": [c["request_id"] for c in calls] if trained else [],
        "protocol": "openai.chat",
        "user_agent": "OpenAI/Python",
        "reward": None,
        "metadata": None,
        "end_reason": None,
        "metrics": None,
    }
    row.update(extra)
    return row


def write_agent_session(out: Path, tok: Any, sid: str = "agent-1") -> dict[str, Any]:
    """The agent session (see the module's text); returns its calls and rows."""

    def enc(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    p0 = enc(
        "<|im_start|>user\nFix the failing test in src/app.py<|im_end|>\n<|im_start|>assistant\n"
    )
    c0 = enc(TOOL_CALL) + [im_end]
    tool = enc(
        "\n<|im_start|>user\n<tool_response>\ndef main(): return 1\n</tool_response><|im_end|>\n"
    )
    p1 = p0 + c0 + tool + enc("<|im_start|>assistant\n")
    c1 = enc("The test expects 2; I changed main to return 2.") + [im_end]
    # The scaffold injected a reminder into the first user message before the third call.
    p2_text = "<|im_start|>user\n" + REMINDER + "\nFix the failing test in src/app.py<|im_end|>\n"
    p2 = enc(p2_text + "<|im_start|>assistant\n") + c0 + tool + enc("<|im_start|>assistant\n")
    p2 = p2 + c1 + enc("\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")
    c2 = enc("You're welcome.") + [im_end]
    calls = [
        _turn(sid, "req-0", 0, p0, c0, TOOL_CALL),
        _turn(sid, "req-1", 1, p1, c1, "The test expects 2; I changed main to return 2."),
        _turn(sid, "req-2", 2, p2, c2, "You're welcome."),
    ]
    meta = json.dumps({"task_id": "swe-42", "group_id": "g-7", "split": "train"})
    main = _row(sid, "t-req-1", calls[:2], reward=1.0, metadata=meta, end_reason="stop")
    rewritten = _row(
        sid,
        "t-req-2",
        [calls[2]],
        parent_thread_id="t-req-1",
        parent_relation="rewritten",
        reward=1.0,
        metadata=meta,
        end_reason="stop",
    )
    retry = _turn(sid, "req-0b", 3, p0, enc("Let me look.") + [im_end], "Let me look.")
    dead = _row(
        sid,
        "t-req-0b",
        [retry],
        parent_thread_id="t-req-1",
        parent_relation="branch",
        dead=True,
        dead_reason="superseded",
        superseded_by="t-req-1",
        reward=1.0,
        metadata=meta,
        end_reason="stop",
    )
    sub_p = enc("<|im_start|>user\nRead src/app.py<|im_end|>\n<|im_start|>assistant\n")
    sub = _turn(sid, "req-sub", 4, sub_p, enc("It returns 1.") + [im_end], "It returns 1.")
    spawn = _row(
        sid,
        "t-req-sub",
        [sub],
        parent_thread_id="t-req-1",
        parent_relation="spawn",
        parent_tool_call_id="call_abc",
        reward=1.0,
        metadata=meta,
        end_reason="stop",
    )
    turns = [*calls, retry, sub]
    rows = [main, rewritten, dead, spawn]
    write_rows(out / "turns", turns, TURN_SCHEMA, "turns", stem=sid)
    write_rows(out / "threads", rows, THREAD_SCHEMA, "threads", stem=sid)
    return {"turns": turns, "rows": rows}


def write_long_session(out: Path, sid: str = "long-1", tokens: int = 100_000) -> dict[str, Any]:
    """One row of ``tokens`` tokens over three calls (the last two extend the first)."""
    rng = random.Random(7)
    ids = [rng.randrange(1000, 30000) for _ in range(tokens)]
    n = tokens // 3
    cuts = [(n - 500, n), (2 * n - 500, 2 * n), (tokens - 500, tokens)]
    calls = []
    for k, (start, end) in enumerate(cuts):
        calls.append(_turn(sid, f"long-{k}", k, ids[:start], ids[start:end], "x"))
    row = _row(sid, "t-long-2", calls, reward=0.5)
    write_rows(out / "turns", calls, TURN_SCHEMA, "turns", stem=sid)
    write_rows(out / "threads", [row], THREAD_SCHEMA, "threads", stem=sid)
    return {"turns": calls, "rows": [row]}


def write_long_prompt_session(
    out: Path, sid: str = "prompt-1", prompt: int = 12_000, sampled: int = 300
) -> dict[str, Any]:
    """One call of ``prompt`` prompt tokens and ``sampled`` sampled ones: its row's first
    trained token is at ``prompt``."""
    rng = random.Random(12)
    ids = [rng.randrange(1000, 30000) for _ in range(prompt + sampled)]
    call = _turn(sid, "lp-0", 0, ids[:prompt], ids[prompt:], "x")
    row = _row(sid, "t-lp-0", [call])
    write_rows(out / "turns", [call], TURN_SCHEMA, "turns", stem=sid)
    write_rows(out / "threads", [row], THREAD_SCHEMA, "threads", stem=sid)
    return {"turns": [call], "rows": [row]}


HOSTILE_SESSION = 'evil&row=x#<img src=x onerror="window.__pwned=1">'
HOSTILE_REQUEST = '<img src=x onerror="window.__pwned=2">'
HOSTILE_TEXT = '<img src=x onerror="window.__pwned=3"><script>window.__pwned=4</script>'


def write_hostile_session(out: Path, tok: Any) -> dict[str, Any]:
    """A session whose id, row id and sampled text are HTML (an agent controls all three)."""

    def enc(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    prompt = enc("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    call = _turn(HOSTILE_SESSION, HOSTILE_REQUEST, 0, prompt, enc(HOSTILE_TEXT), HOSTILE_TEXT)
    row = _row(HOSTILE_SESSION, "t-" + HOSTILE_REQUEST, [call])
    write_rows(out / "turns", [call], TURN_SCHEMA, "turns", stem="hostile")
    write_rows(out / "threads", [row], THREAD_SCHEMA, "threads", stem="hostile")
    return {"turns": [call], "rows": [row]}


RUN_STATUSES = ("stop", "stop", "stop", "max_calls", "limit")


def write_run(
    out: Path, steps: int = 12, groups_per_step: int = 3, n: int = 14, seed: int = 3
) -> list[dict[str, Any]]:
    """A GRPO run's shards: ``steps`` trainer steps of ``groups_per_step`` groups of ``n``
    rollouts, one session each (two calls in one row, sampled under the step's weights
    ``v{step}``, the second call under ``v{step+1}`` in every fifth session: the weights moved
    mid-session), metadata as a rollout sets it plus ``trainer_step``, a reward that grows with
    the step, a status (end reason) of RUN_STATUSES, calls a minute apart per step. Written in
    one shard per folder; returns one dict per session: id, step, group, index, reward,
    status, tokens, trained, versions, started_at, ended_at."""
    rng = random.Random(seed)
    turns, rows, truth = [], [], []
    for step in range(steps):
        for g in range(groups_per_step):
            gid = f"grpo-{step:02d}-{g}"
            for i in range(n):
                sid = f"{gid}-{i}"
                prompt = [rng.randrange(1000, 30000) for _ in range(20)]
                first = [rng.randrange(1000, 30000) for _ in range(rng.randrange(5, 30))]
                tool = [rng.randrange(1000, 30000) for _ in range(8)]
                second = [rng.randrange(1000, 30000) for _ in range(rng.randrange(5, 30))]
                t0 = 1_700_000_000.0 + step * 60 + rng.random() * 20
                c0 = _turn(sid, f"{sid}-r0", 0, prompt, first, "x")
                p1 = prompt + first + tool
                c1 = _turn(sid, f"{sid}-r1", 1, p1, second, "y")
                c0["started_at"], c0["latency_s"] = t0, 1.5
                c1["started_at"], c1["latency_s"] = t0 + 2.0, 2.5
                moved = (i % 5) == 4
                v0, v1 = f"v{step}", f"v{step + 1}" if moved else f"v{step}"
                s0, e0 = len(prompt), len(prompt) + len(first)
                s1, e1 = len(p1), len(p1) + len(second)
                spans = [{"version": v0, "start": s0, "end": e0}]
                spans.append({"version": v1, "start": s1, "end": e1})
                c0["weight_versions"] = [{"version": v0, "start": 0, "end": len(first)}]
                c1["weight_versions"] = [{"version": v1, "start": 0, "end": len(second)}]
                reward = round(min(1.0, max(0.0, step / steps + rng.uniform(-0.3, 0.3))), 6)
                status = RUN_STATUSES[rng.randrange(len(RUN_STATUSES))]
                meta = {
                    "task": f"task-{g}",
                    "group_id": gid,
                    "rollout_id": gid,
                    "index": i,
                    "trainer_step": step,
                    "split": "train",
                }
                row = _row(
                    sid,
                    f"t-{sid}",
                    [c0, c1],
                    reward=reward,
                    metadata=json.dumps(meta),
                    end_reason=status,
                    weight_versions=spans,
                    metrics=json.dumps({"calls": 2, "wall_time_s": 4.5}),
                )
                turns += [c0, c1]
                rows.append(row)
                truth.append(
                    {
                        "id": sid,
                        "step": step,
                        "group": gid,
                        "index": i,
                        "reward": reward,
                        "status": status,
                        "tokens": len(row["input_ids"]),
                        "trained": sum(row["loss_mask"]),
                        "versions": list(dict.fromkeys([v0, v1])),
                        "started_at": t0,
                        "ended_at": t0 + 4.5,
                    }
                )
    write_rows(out / "turns", turns, TURN_SCHEMA, "turns", stem="run")
    write_rows(out / "threads", rows, THREAD_SCHEMA, "threads", stem="run")
    return truth
