"""Rows whose weights nobody pushed: the windows in which a policy server's answers changed
without a weight update, and the thread rows that train a call answered in one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    # Imported here: pyarrow.dataset brings pandas (0.4 s), and the proxy imports this module
    # at start for the file's name alone.
    import pyarrow.dataset as ds

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
