"""Read thread shards into padded batches for a trainer.

rows = load_threads("OUT")                      # OUT/threads, late rewards from OUT/rewards joined
batch = to_rl_batch(rows, pad_id=151643)        # verl-style prompts / responses (numpy); rows
                                                # without a reward: missing_reward=, kinds=
batch = to_batch(rows, pad_id=151643)           # or whole rows padded to one length (numpy)
tensors = to_torch(batch)                       # torch tensors, if torch is installed
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Literal, TypedDict

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds

from capture.storage.rewards import REWARDS_DIR, join_rewards, load_rewards
from capture.storage.shards import THREAD_SCHEMA
from capture.trajectory.export import DEAD_EMPTY
from capture.trajectory.kinds import MAIN, THREAD_KINDS

logger = logging.getLogger(__name__)

# Folders of an output directory: a folder holding any of them is OUT itself.
_OUT_FOLDERS = ("threads", "turns", "failed", "journal", REWARDS_DIR)


def _locate(path: str | os.PathLike[str]) -> tuple[Path | None, Path]:
    """(the thread shards to read, or None if there are none; the OUT folder of late rewards)."""
    p = Path(path)
    if p.is_dir() and p.name != "threads" and any((p / d).is_dir() for d in _OUT_FOLDERS):
        threads = p / "threads"
        return (threads if threads.is_dir() else None), p
    shards_dir = p if p.is_dir() else p.parent
    return p, shards_dir.parent


# How far the error of a path without shards looks for OUT folders nearby (folders visited).
_NEARBY_LIMIT = 400
_SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".cache"}


def _shard_count(out: Path) -> int:
    """How many thread shards an OUT folder holds (0: it is not one)."""
    try:
        return sum(1 for f in (out / "threads").glob("*.parquet") if not f.name.startswith("."))
    except OSError:
        return 0


def _outs_under(root: Path, depth: int = 3) -> list[tuple[Path, int]]:
    """OUT folders (holding threads/*.parquet) at or under ``root``, ``depth`` levels down at
    most, a bounded number of folders looked at."""
    found: list[tuple[Path, int]] = []
    queue = [(root, 0)]
    seen = 0
    while queue and seen < _NEARBY_LIMIT:
        folder, level = queue.pop(0)
        seen += 1
        count = _shard_count(folder)
        if count:
            found.append((folder, count))
            continue
        if level >= depth:
            continue
        try:
            subs = sorted(d for d in folder.iterdir() if d.is_dir() and d.name not in _SKIP_DIRS)
        except OSError:
            continue
        queue += [(d, level + 1) for d in subs if not d.name.startswith(".")]
    return found


def _nearby(path: Path) -> str:
    """' Did you mean X?' naming OUT folders near ``path`` (inside it, or beside it with a
    name like it), or ''."""
    import difflib

    if path.is_dir():
        found = _outs_under(path)
    else:
        parent = path.parent if str(path.parent) else Path(".")
        found = _outs_under(parent, depth=2) if parent.is_dir() else []
        names = [str(f.relative_to(parent)) for f, _ in found if f != parent]
        close = set(difflib.get_close_matches(path.name, names, n=3, cutoff=0.5))
        close |= {n for n in names if n.split(os.sep)[0].startswith(path.name)}
        found = [(f, n) for f, n in found if f != parent]
        if close:  # else: every OUT there (a few at most are named)
            found = [(f, n) for f, n in found if str(f.relative_to(parent)) in close]
    if not found:
        return ""
    shown = [f"{f} ({n} thread shard{'s' if n != 1 else ''})" for f, n in found[:3]]
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return f" Did you mean {' or '.join(shown)}{more}?"


def _check_shards(path: str | os.PathLike[str], threads: Path) -> None:
    """A FileNotFoundError saying what was looked for, and where shards are if nearby, when
    ``threads`` (what ``_locate`` found for ``path``) is missing, or is a folder of other files
    with no shard in it (an example's ``--out`` folder, its shards one folder down)."""
    wants = (
        "load_threads reads OUT (the proxy's output folder, agenttap_out: it holds threads/), "
        "OUT/threads, or one .parquet shard"
    )
    if not threads.exists():
        raise FileNotFoundError(
            f"agenttap: no thread shards at {os.fspath(path)!r}: it does not exist; {wants}."
            + _nearby(Path(path))
        )
    if not threads.is_dir():
        return
    entries = [e for e in threads.iterdir() if not e.name.startswith((".", "_"))]
    if not entries or any(e.suffix == ".parquet" for e in entries):
        return  # no rows yet, or shards: read them
    raise FileNotFoundError(
        f"agenttap: no thread shards in {os.fspath(path)!r}: it holds no .parquet file and no "
        f"threads/ folder (it holds {', '.join(sorted(e.name for e in entries)[:5])}"
        f"{'...' if len(entries) > 5 else ''}); {wants}." + _nearby(threads)
    )


def load_threads(
    path: str | os.PathLike[str],
    columns: list[str] | None = None,
    rewards: bool = True,
) -> list[dict[str, Any]]:
    """All thread rows under ``path``, as dicts.

    ``path``: ``OUT`` itself (a folder holding ``threads/``, or another of OUT's folders),
    ``OUT/threads`` (any folder of thread shards), or one shard file.
    ``columns``: read only these (default: all).
    ``rewards``: join the late rewards of ``capture.storage.rewards`` (``OUT/rewards/``, the folder
    beside the shards' folder) onto the rows' ``reward`` (the reward set last wins and replaces
    the one the row was written with; see ``capture.storage.rewards.join_rewards``). Skipped when
    ``columns`` leaves out ``reward``; ``session_id`` and ``thread_id`` are read for the join
    and dropped again if ``columns`` leaves them out."""
    threads, out_dir = _locate(path)
    if threads is None:
        return []
    _check_shards(path, threads)
    dataset = ds.dataset(str(threads), format="parquet")
    if not dataset.files:
        return []
    # The schema of the first file, with the columns of THREAD_SCHEMA it lacks (shards written
    # before a column existed, such as thread_kind): null for the rows of those files.
    schema = pa.unify_schemas([dataset.schema, THREAD_SCHEMA])
    if schema != dataset.schema:
        dataset = ds.dataset(str(threads), format="parquet", schema=schema)
    join = rewards and (columns is None or "reward" in columns)
    read = columns
    if join and columns is not None:
        read = list(dict.fromkeys([*columns, "session_id", "thread_id"]))
    rows: list[dict[str, Any]] = dataset.to_table(columns=read).to_pylist()
    if columns is None:
        mark_unverified(rows, out_dir)
    if join:
        late = load_rewards(out_dir)
        if late.num_rows:
            rows = join_rewards(rows, late)
        if columns is not None:
            # Only what was asked: not the join's keys, nor the reward_source it sets.
            wanted = set(columns)
            rows = [{k: v for k, v in row.items() if k in wanted} for row in rows]
    return rows


# Windows in which a policy server's answers changed without a weight update (capture/gateway.py
# writes one JSON line per window: backend, since, found, reason).
WEIGHTS_UNVERIFIED_FILE = "weights_unverified.jsonl"


def unverified_request_ids(out_dir: Path) -> set[str]:
    """The calls a policy server answered while its weights were not the ones pushed: those
    of OUT/turns whose backend is a window's and whose time (``started_at`` to
    ``started_at + latency_s``) overlaps it (``since`` to ``found``)."""
    windows: dict[str, list[tuple[float, float]]] = {}
    try:
        lines = (out_dir / WEIGHTS_UNVERIFIED_FILE).read_text().splitlines()
    except OSError:
        return set()
    for line in lines:
        try:
            window = json.loads(line)
            span = (float(window["since"]), float(window["found"]))
            windows.setdefault(str(window["backend"]), []).append(span)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by a crash
    turns = out_dir / "turns"
    if not windows or not turns.is_dir():
        return set()
    wanted = ["request_id", "backend", "started_at", "latency_s"]
    table = ds.dataset(str(turns), format="parquet").to_table(columns=wanted).to_pylist()
    found = set()
    for call in table:
        start = call.get("started_at") or 0.0
        end = start + (call.get("latency_s") or 0.0)
        for since, until in windows.get(str(call.get("backend")), ()):
            if start <= until and end >= since:
                found.add(str(call["request_id"]))
    return found


def mark_unverified(rows: list[dict[str, Any]], out_dir: Path) -> None:
    """Set each row's ``weights_unverified`` where OUT holds windows of weights nobody pushed:
    True where it trains a call a policy server answered in one (``unverified_request_ids``),
    else False; select_rows leaves those rows out. Without windows rows are left as read."""
    if not (out_dir / WEIGHTS_UNVERIFIED_FILE).is_file():
        return
    bad = unverified_request_ids(out_dir)
    for row in rows:
        trained = row.get("trained_request_ids") or ()
        row["weights_unverified"] = bool(bad) and any(rid in bad for rid in trained)


def to_batch(
    rows: list[dict[str, Any]],
    pad_id: int = 0,
    max_len: int | None = None,
    left_pad: bool = False,
) -> dict[str, np.ndarray]:
    """Pad ``input_ids``, ``loss_mask``, ``logprobs`` and ``provenance`` to one length.

    ``attention_mask`` is 1 on real tokens. Rows longer than ``max_len`` are cut at the end.
    """
    lengths = [len(r["input_ids"]) for r in rows]
    width = max(lengths, default=0) if max_len is None else max_len
    n = len(rows)
    out: dict[str, np.ndarray] = {
        "input_ids": np.full((n, width), pad_id, dtype=np.int64),
        "attention_mask": np.zeros((n, width), dtype=np.int64),
        "loss_mask": np.zeros((n, width), dtype=np.int64),
        "logprobs": np.zeros((n, width), dtype=np.float32),
        "provenance": np.zeros((n, width), dtype=np.int8),
    }
    for i, row in enumerate(rows):
        k = min(len(row["input_ids"]), width)
        sl = slice(width - k, width) if left_pad else slice(0, k)
        out["input_ids"][i, sl] = row["input_ids"][:k]
        out["attention_mask"][i, sl] = 1
        out["loss_mask"][i, sl] = row["loss_mask"][:k]
        out["logprobs"][i, sl] = row["logprobs"][:k]
        out["provenance"][i, sl] = row["provenance"][:k]
    return out


Truncation = Literal["error", "left", "right", "middle"]
_TRUNCATIONS = ("error", "left", "right", "middle")
MissingReward = Literal["error", "drop", "zero"]
_MISSING_REWARDS = ("error", "drop", "zero")
# Sessions a missing-reward error names (then how many more).
_NAMED_SESSIONS = 5


def row_kind(row: Mapping[str, Any]) -> str:
    """A row's ``thread_kind``; ``main`` for rows written before the column existed (null)."""
    return row.get("thread_kind") or MAIN


def _reward_of(row: Mapping[str, Any]) -> float | None:
    reward = row.get("reward")
    if reward is None or (isinstance(reward, float) and np.isnan(reward)):
        return None
    return float(reward)


def select_rows(
    rows: list[dict[str, Any]],
    missing_reward: MissingReward = "error",
    kinds: Collection[str] | None = None,
) -> list[dict[str, Any]]:
    """The rows :func:`to_rl_batch` batches: those of ``kinds`` (None: all), then, for rows
    without a reward, what ``missing_reward`` says (see there). Never a dead end with no visible
    output (``dead_reason`` ``"empty"``): its client asked again, and the retry's row is the
    rollout's, so a trainer that groups per row counts the rollout once. Never a row marked
    ``weights_unverified`` (a policy server's weights changed without an update while it
    sampled them: they are not the policy's)."""
    if missing_reward not in _MISSING_REWARDS:
        raise ValueError(
            f"missing_reward must be one of {_MISSING_REWARDS}, not {missing_reward!r}"
        )
    rows = [r for r in rows if r.get("dead_reason") != DEAD_EMPTY]
    rows = [r for r in rows if not r.get("weights_unverified")]
    if kinds is not None:
        if isinstance(kinds, str):
            kinds = (kinds,)
        unknown = sorted(set(kinds) - set(THREAD_KINDS))
        if unknown:
            raise ValueError(f"kinds: unknown thread_kind(s) {unknown}; known: {THREAD_KINDS}")
        rows = [r for r in rows if row_kind(r) in kinds]
    missing = [r for r in rows if _reward_of(r) is None]
    if not missing or missing_reward == "zero":
        return rows
    if missing_reward == "drop":
        return [r for r in rows if _reward_of(r) is not None]
    sessions = list(dict.fromkeys(str(r.get("session_id")) for r in missing))
    named = ", ".join(repr(s) for s in sessions[:_NAMED_SESSIONS])
    if len(sessions) > _NAMED_SESSIONS:
        named += f" and {len(sessions) - _NAMED_SESSIONS} more"
    auxiliary = sum(1 for r in missing if row_kind(r) == "auxiliary")
    aux_note = (
        f" ({auxiliary} of them auxiliary: side calls such as titles and routers, which a "
        "session's reward leaves out unless closed with reward_auxiliary)"
        if auxiliary
        else ""
    )
    raise ValueError(
        f"{len(missing)} of {len(rows)} rows have no reward{aux_note}: rows of session(s) "
        f"{named}; "
        "give those sessions a reward (at close, or a late one), or choose: "
        "missing_reward='drop' (leave those rows out), missing_reward='zero' (reward 0), "
        "kinds=('main', 'subagent') (leave auxiliary rows out)"
    )


class RLBatch(TypedDict):
    """What :func:`to_rl_batch` returns (``n`` rows, ``P`` prompt and ``R`` response columns)."""

    prompts: np.ndarray  # (n, P) int64, left-padded with pad_id
    responses: np.ndarray  # (n, R) int64, right-padded with pad_id
    response_mask: np.ndarray  # (n, R) int64: 1 on the policy's trained tokens
    rollout_log_probs: np.ndarray  # (n, R) float32: the sampler's logprobs, 0 elsewhere
    input_ids: np.ndarray  # (n, P + R) int64: prompts ++ responses
    attention_mask: np.ndarray  # (n, P + R) int64: 1 on real tokens
    position_ids: np.ndarray  # (n, P + R) int64: clip(cumsum(attention_mask) - 1, 0)
    reward: np.ndarray  # (n,) float64 (missing_reward: rows without one dropped, 0, or refused)
    token_level_rewards: np.ndarray  # (n, R) float32: reward on the last trained token
    group_id: list[str]  # metadata "group_id", else the session id
    session_id: list[str | None]
    thread_id: list[str | None]
    # The oldest and newest weights that gave a trained token's logprob (version labels, in
    # version_key's order); None: the row says none (written before weight_versions).
    min_weight_version: list[str | None]
    max_weight_version: list[str | None]


def version_key(version: str) -> tuple[Any, ...]:
    """The order of weight version labels: their numbers compared as numbers ("step-9" before
    "step-10", "2" before "10"), the rest as text; "default" (vLLM's label before any update)
    before every other."""
    if version == "default":
        return ((0, ""),)
    parts = re.split(r"(\d+)", version)
    return (
        (1, ""),
        *((2, int(p)) if p.isdigit() else (3, p) for p in parts if p),
    )


def trained_versions(row: Mapping[str, Any]) -> list[str]:
    """The versions of a thread row's ``weight_versions`` spans that hold a trained token
    (``loss_mask`` 1), oldest first (``version_key``)."""
    mask = row.get("loss_mask") or []
    found = {
        span["version"]
        for span in row.get("weight_versions") or []
        if any(mask[span["start"] : span["end"]])
    }
    return sorted(found, key=version_key)


def to_rl_batch(
    rows: list[dict[str, Any]],
    pad_id: int,
    max_prompt_len: int | None = None,
    max_response_len: int | None = None,
    truncation: Truncation = "error",
    missing_reward: MissingReward = "error",
    kinds: Collection[str] | None = None,
) -> RLBatch:
    """Split thread rows into prompt and response, padded as verl's PPO / GRPO batches are.

    Which rows: ``kinds`` keeps only rows of these ``thread_kind`` values (None, the default: all;
    ``("main", "subagent")`` leaves out auxiliary rows, the side calls a session's reward is not
    set on by default; a row written before the column existed counts as ``main``). A row with
    no reward (null) is refused: ``missing_reward="error"`` (default) raises ValueError naming
    the first sessions whose rows have none; ``"drop"`` leaves those rows out of the batch;
    ``"zero"`` batches them with reward 0. The batch's ``session_id`` and ``thread_id`` say
    which rows it holds.

    A row's *prompt* is its tokens before its first trained token (the first ``loss_mask`` 1);
    its *response* is the rest: the policy's sampled tokens and, in a multi-turn row, the tool /
    environment tokens between its calls (``response_mask`` 0 on these, as verl's agent loop
    masks tool responses). A row that trains nothing has all its tokens as prompt and an empty
    response.

    Returns numpy arrays (see :class:`RLBatch`): ``prompts`` left-padded, ``responses``
    right-padded, ``input_ids`` = ``prompts`` ++ ``responses``, ``attention_mask``,
    ``position_ids`` (``clip(cumsum(attention_mask) - 1, min=0)``, as verl computes them),
    ``min_weight_version`` / ``max_weight_version`` (the oldest and newest weights that gave a
    trained token's logprob, from the row's ``weight_versions``: a trainer's staleness check),
    ``response_mask``, ``rollout_log_probs``, ``reward`` (0 for a row without one only with
    ``missing_reward="zero"``), ``token_level_rewards`` (the row's reward on its last
    ``response_mask`` 1 token, 0 elsewhere; all 0 for a row that trains nothing), and the lists
    ``group_id`` (the ``"group_id"`` of the row's ``metadata`` JSON, else its ``session_id``;
    verl's GRPO groups by ``non_tensor_batch["uid"]``: pass it as that), ``session_id`` and
    ``thread_id``.

    ``max_prompt_len`` / ``max_response_len``: pad to exactly this width (default: the longest in
    the batch). ``truncation`` for what exceeds them: ``"error"`` (default) raises ValueError
    naming the row and its lengths; otherwise a prompt keeps its end (``"left"``), its beginning
    (``"right"``) or both halves (``"middle"``), as verl's ``truncation`` option does, and a
    response over ``max_response_len`` is cut at its end (its later tokens are dropped: the kept
    ones stay exactly the ones sampled in that context).
    """
    if truncation not in _TRUNCATIONS:
        raise ValueError(f"truncation must be one of {_TRUNCATIONS}, not {truncation!r}")
    for name, limit in (("max_prompt_len", max_prompt_len), ("max_response_len", max_response_len)):
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise ValueError(f"{name} must be a positive int or None, not {limit!r}")
    rows = select_rows(rows, missing_reward, kinds)

    prompts: list[np.ndarray] = []
    responses: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    rewards = np.full(len(rows), np.nan, dtype=np.float64)
    group_ids: list[str] = []
    session_ids: list[str | None] = []
    thread_ids: list[str | None] = []
    versions: list[list[str]] = []
    for i, row in enumerate(rows):
        label = f"row {i} (session {row.get('session_id')!r}, thread {row.get('thread_id')!r})"
        ids, mask, logprobs = _aligned(row, label)
        trained = np.flatnonzero(mask)
        first = int(trained[0]) if trained.size else len(ids)
        prompt = _truncate_prompt(ids[:first], max_prompt_len, truncation, label)
        response = slice(first, len(ids))
        if max_response_len is not None and len(ids) - first > max_response_len:
            if truncation == "error":
                raise ValueError(
                    f"{label}: response is {len(ids) - first} tokens, over "
                    f"max_response_len={max_response_len} (prompt {first} tokens); raise the "
                    "limit, or pass truncation='left' / 'right' / 'middle' to cut responses at "
                    "their end"
                )
            response = slice(first, first + max_response_len)
        prompts.append(prompt)
        responses.append((ids[response], mask[response], logprobs[response]))
        reward = _reward_of(row)
        if reward is not None:
            rewards[i] = reward
        elif missing_reward == "zero":
            rewards[i] = 0.0
        session_ids.append(row.get("session_id"))
        thread_ids.append(row.get("thread_id"))
        group_ids.append(_group_id(row, label))
        versions.append(trained_versions(row))

    n = len(rows)
    width_p = max_prompt_len if max_prompt_len is not None else max(map(len, prompts), default=0)
    width_r = (
        max_response_len
        if max_response_len is not None
        else max((len(r[0]) for r in responses), default=0)
    )
    out_prompts = np.full((n, width_p), pad_id, dtype=np.int64)
    prompt_mask = np.zeros((n, width_p), dtype=np.int64)
    out_responses = np.full((n, width_r), pad_id, dtype=np.int64)
    response_attn = np.zeros((n, width_r), dtype=np.int64)
    response_mask = np.zeros((n, width_r), dtype=np.int64)
    rollout_log_probs = np.zeros((n, width_r), dtype=np.float32)
    token_level_rewards = np.zeros((n, width_r), dtype=np.float32)
    for i, (prompt, (r_ids, r_mask, r_logprobs)) in enumerate(zip(prompts, responses, strict=True)):
        if len(prompt):
            out_prompts[i, width_p - len(prompt) :] = prompt
            prompt_mask[i, width_p - len(prompt) :] = 1
        k = len(r_ids)
        out_responses[i, :k] = r_ids
        response_attn[i, :k] = 1
        response_mask[i, :k] = r_mask
        rollout_log_probs[i, :k] = r_logprobs
        trained = np.flatnonzero(r_mask)
        if trained.size:
            token_level_rewards[i, trained[-1]] = rewards[i]
    attention_mask = np.concatenate([prompt_mask, response_attn], axis=1)
    return RLBatch(
        prompts=out_prompts,
        responses=out_responses,
        response_mask=response_mask,
        rollout_log_probs=rollout_log_probs,
        input_ids=np.concatenate([out_prompts, out_responses], axis=1),
        attention_mask=attention_mask,
        position_ids=np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None),
        reward=rewards,
        token_level_rewards=token_level_rewards,
        group_id=group_ids,
        session_id=session_ids,
        thread_id=thread_ids,
        min_weight_version=[v[0] if v else None for v in versions],
        max_weight_version=[v[-1] if v else None for v in versions],
    )


def _aligned(row: Mapping[str, Any], label: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The row's ``input_ids``, ``loss_mask`` (0/1) and ``logprobs``, checked to be aligned."""
    missing = [c for c in ("input_ids", "loss_mask", "logprobs") if row.get(c) is None]
    if missing:
        raise ValueError(f"{label} has no {', '.join(missing)} (read those columns)")
    ids = np.asarray(row["input_ids"], dtype=np.int64)
    mask = (np.asarray(row["loss_mask"]) != 0).astype(np.int64)
    logprobs = np.asarray(row["logprobs"], dtype=np.float32)
    if not len(ids) == len(mask) == len(logprobs):
        raise ValueError(
            f"{label}: input_ids, loss_mask and logprobs differ in length "
            f"({len(ids)}, {len(mask)}, {len(logprobs)})"
        )
    return ids, mask, logprobs


def _truncate_prompt(
    prompt: np.ndarray, limit: int | None, truncation: Truncation, label: str
) -> np.ndarray:
    n = len(prompt)
    if limit is None or n <= limit:
        return prompt
    if truncation == "error":
        raise ValueError(
            f"{label}: prompt is {n} tokens, over max_prompt_len={limit}; raise the limit, or "
            "pass truncation='left' (keep its end), 'right' (keep its beginning) or 'middle'"
        )
    if truncation == "left":
        return prompt[n - limit :]
    if truncation == "right":
        return prompt[:limit]
    half = limit // 2
    return np.concatenate([prompt[:half], prompt[n - (limit - half) :]])


def _group_id(row: Mapping[str, Any], label: str) -> str:
    metadata = row.get("metadata")
    if metadata:
        try:
            parsed = json.loads(metadata)
        except (TypeError, ValueError):
            logger.warning("%s: metadata is not JSON; grouping it by its session", label)
            parsed = None
        if isinstance(parsed, dict) and parsed.get("group_id") is not None:
            group = parsed["group_id"]
            return group if isinstance(group, str) else json.dumps(group, sort_keys=True)
    return str(row.get("session_id"))


def to_torch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch with its numpy arrays as torch tensors (sharing memory); other entries (the
    lists of ids) pass through unchanged. Needs torch; the numpy batches do not."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            "capture.reader.to_torch needs PyTorch, which is not installed: pip install torch "
            "(to_batch and to_rl_batch give numpy arrays without it)"
        ) from exc
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}
