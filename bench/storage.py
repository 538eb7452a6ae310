"""Bytes per stored token of the journal and the shards (issue 19, item 5), old settings vs new.

    .venv/bin/python bench/storage.py [--sessions 3] [--calls 50] [--context 20000] [--seed 0]

Builds --sessions agent-like sessions with the real Qwen3 template: a system prompt, a task, then
--calls calls whose conversation grows to about --context tokens (the agent's replies, 20-30% of
the tokens, with random logprobs shaped like a sampler's; tool outputs cut from this repository's
own files; one call in each session resent by its client, so a dead row too). Each session is
recorded through ``SessionStore`` twice, into two folders: with the settings before issue 19
(journal lines of JSON lists, ``compression="zstd"`` and pyarrow's defaults otherwise) and with
the current ones. Prints, old and new: bytes per token; write ms (the journal: encoding,
writing and fsyncing every line, ``sessions._append``; shards: ``write_rows``); read ms (the
journal: decoding its lines, ``journal_lines.read``; shards: ``pyarrow.dataset`` to a table,
best of 3); new / old of the bytes.

Bytes per token (docs/SHARDS.md, "Storage"): bytes on disk divided by the tokens of the
session's thread rows (the sum of their ``input_ids`` lengths). The journal's are its size at
its peak, when the session's last call was journaled (it only grows, then it is removed); the
shards' are the turns / threads files written when the session ends.

Checks on the way: both folders hold the same rows, every column (read back identical), and
the shards recovered from each copy of the journal (as after ``kill -9``) equal the live ones.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import pyarrow as pa  # noqa: E402
import pyarrow.dataset as ds  # noqa: E402

import capture.storage.sessions as sessions_mod  # noqa: E402
import capture.storage.shards as shards_mod  # noqa: E402
from capture.storage import journal_lines  # noqa: E402
from capture.storage.sessions import SessionStore  # noqa: E402
from rewriter.template import ChatTemplate  # noqa: E402
from tests.support.agent_sessions import Script, build, corpus, record  # noqa: E402
from tests.support.paths import QWEN3  # noqa: E402


@dataclass
class Part:
    bytes: int = 0
    write_s: float = 0.0
    read_s: float = 0.0


@dataclass
class Sizes:
    parts: dict[str, Part] = field(
        default_factory=lambda: {name: Part() for name in ("journal", "turns", "threads")}
    )
    tokens: int = 0
    tables: dict[str, pa.Table] = field(default_factory=dict)


def old_parquet_options(schema: pa.Schema) -> dict[str, Any]:
    return {"compression": "zstd"}  # what capture/storage/shards.py wrote with before issue 19


@contextmanager
def settings(old: bool) -> Iterator[None]:
    saved = (journal_lines.COMPACT, shards_mod.parquet_options)
    if old:
        journal_lines.COMPACT = False
        shards_mod.parquet_options = old_parquet_options
    try:
        yield
    finally:
        journal_lines.COMPACT, shards_mod.parquet_options = saved


@contextmanager
def timing(
    module: Any, name: str, seconds: Callable[[tuple[Any, ...], float], None]
) -> Iterator[None]:
    """Calls ``seconds(args, time spent)`` after each call of ``module.name``."""
    original: Callable[..., Any] = getattr(module, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds(args, time.perf_counter() - start)

    setattr(module, name, timed)
    try:
        yield
    finally:
        setattr(module, name, original)


def sorted_table(folder: Path, keys: list[str]) -> pa.Table:
    return (
        ds.dataset(str(folder), format="parquet")
        .to_table()
        .sort_by([(k, "ascending") for k in keys])
    )


def read_time(folder: Path) -> float:
    start = time.perf_counter()
    ds.dataset(str(folder), format="parquet").to_table()
    return time.perf_counter() - start


def run(template: ChatTemplate, scripts: list[Script], work: Path, old: bool) -> Sizes:
    mode = "old" if old else "new"
    out, recovered = work / mode, work / f"recovered-{mode}"
    sizes = Sizes()
    parts = sizes.parts

    def journal_s(_args: tuple[Any, ...], s: float) -> None:
        parts["journal"].write_s += s

    def shard_s(args: tuple[Any, ...], s: float) -> None:  # write_rows(dir, rows, schema, prefix)
        if args[3] in parts:
            parts[args[3]].write_s += s

    with (
        settings(old),
        timing(sessions_mod, "_append", journal_s),
        timing(sessions_mod, "write_rows", shard_s),
    ):
        store = SessionStore(out, template)
        for script in scripts:
            record(store, script)
            (journal,) = (out / "journal").glob(f"{script.session_id}-*.jsonl")
            parts["journal"].bytes += journal.stat().st_size  # its peak: every call is in
            kept = recovered / "journal" / journal.name  # as kill -9 would leave it
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(journal, kept)
            start = time.perf_counter()
            entries = list(journal_lines.read(kept))
            parts["journal"].read_s += time.perf_counter() - start
            assert all(e is not None for e in entries)
            store.end_session(script.session_id)
        SessionStore(recovered, template).recover()
    keys = {"turns": ["session_id", "turn_index"], "threads": ["session_id", "thread_id"]}
    for name in ("turns", "threads"):
        parts[name].bytes = sum(p.stat().st_size for p in (out / name).glob("*.parquet"))
        parts[name].read_s = min(read_time(out / name) for _ in range(3))
        sizes.tables[name] = sorted_table(out / name, keys[name])
        # Recovery after kill -9 from the journals gives the same shards.
        again = sorted_table(recovered / name, keys[name])
        assert again.equals(sizes.tables[name]), f"{mode}: {name} recovered differently"
    input_ids = sizes.tables["threads"].column("input_ids").to_pylist()
    sizes.tokens = sum(len(ids) for ids in input_ids)
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--context", type=int, default=20_000, help="tokens at the last call")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    template = ChatTemplate(QWEN3)
    text = corpus()
    scripts = [
        build(template, text, f"agent{i}", args.calls, args.context, args.seed + i)
        for i in range(args.sessions)
    ]
    work = Path(tempfile.mkdtemp(prefix="agenttap-bench-storage-"))
    try:
        old = run(template, scripts, work, old=True)
        new = run(template, scripts, work, old=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name in ("turns", "threads"):
        assert new.tables[name].equals(old.tables[name]), (
            f"{name}: new shards read back differently"
        )
    assert new.tokens == old.tokens
    calls = sum(len(s.calls) for s in scripts)
    rows = new.tables["threads"].num_rows
    print(
        f"\n{args.sessions} sessions, {calls} calls, {rows} thread rows, {new.tokens} thread "
        f"tokens (context at the last call about {args.context}); B/tok = bytes on disk / thread "
        "tokens; journal at its peak"
    )
    print(
        f"{'':<18} {'old B/tok':>9} {'new B/tok':>9} {'new/old':>8} "
        f"{'old w ms':>9} {'new w ms':>9} {'old r ms':>9} {'new r ms':>9}"
    )

    def total(sizes: Sizes, names: tuple[str, ...]) -> Part:
        got = [sizes.parts[n] for n in names]
        return Part(*(sum(getattr(p, a) for p in got) for a in ("bytes", "write_s", "read_s")))

    for label, names in [
        ("journal (peak)", ("journal",)),
        ("turns", ("turns",)),
        ("threads", ("threads",)),
        ("shards", ("turns", "threads")),
        ("journal + shards", ("journal", "turns", "threads")),
    ]:
        o, n = total(old, names), total(new, names)
        print(
            f"{label:<18} {o.bytes / old.tokens:>9.2f} {n.bytes / new.tokens:>9.2f} "
            f"{n.bytes / o.bytes:>8.3f} {o.write_s * 1e3:>9.1f} {n.write_s * 1e3:>9.1f} "
            f"{o.read_s * 1e3:>9.1f} {n.read_s * 1e3:>9.1f}"
        )
    print("read back identical, old vs new, live vs recovered (every column): yes")


if __name__ == "__main__":
    main()
