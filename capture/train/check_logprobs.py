"""Does the trainer's own forward agree with the rows? ``python -m capture.train.check_logprobs``.

    .venv-train/bin/python -m capture.train.check_logprobs OUT --model DIR [--tolerance 1e-3]

For every thread row under OUT (``capture.storage.reader.load_threads``: OUT, OUT/threads or one
shard), the HF transformers model in DIR (float32) scores the row's ``input_ids`` in one forward
pass, and on every token the row trains (``loss_mask`` 1) its log-probability is compared with
the row's ``logprobs`` (what the policy sampled it with). Printed: rows checked, tokens
compared, max |diff| (and its importance ratio, exp(max |diff|)), the worst rows. Exits 1 when
max |diff| is over ``--tolerance``: the trainer would not be training the policy that sampled
the rows (other weights, another dtype, a different model, or tokens the rows got wrong).

DIR must hold the weights that sampled the rows: after a weight update, rows sampled under
several versions need each version's folder (``--version V`` checks only the tokens a version
sampled, by the rows' ``weight_versions``); without it, over rows of several versions, it names
them (with their trained tokens) and suggests ``--version``. Only the positions scored are put
through the output layer, so a 13k-token row of a 150k-word vocabulary needs no 8 GB of logits.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capture.storage.reader import load_threads

DEFAULT_TOLERANCE = 1e-3
WORST_SHOWN = 5


@dataclass
class RowCheck:
    session_id: str
    thread_id: str
    tokens: int
    max_diff: float
    # The position in input_ids of the worst token (-1: none checked).
    worst_position: int = -1


@dataclass
class Report:
    rows: list[RowCheck] = field(default_factory=list)
    skipped: int = 0

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.rows)

    @property
    def max_diff(self) -> float:
        return max((r.max_diff for r in self.rows), default=0.0)

    def worst(self, k: int = WORST_SHOWN) -> list[RowCheck]:
        return sorted(self.rows, key=lambda r: -r.max_diff)[:k]


def positions_to_check(row: Mapping[str, Any], version: str | None = None) -> list[int]:
    """Positions of ``input_ids`` whose logprob the row holds and trains (``loss_mask`` 1;
    position 0 has no context and is never one); with ``version``, only those the row's
    ``weight_versions`` say that version sampled."""
    mask = row.get("loss_mask") or []
    wanted = [i for i, m in enumerate(mask) if m and i > 0]
    if version is None:
        return wanted
    sampled: set[int] = set()
    for span in row.get("weight_versions") or []:
        if span.get("version") == version:
            sampled.update(range(int(span["start"]), int(span["end"])))
    return [i for i in wanted if i in sampled]


def versions_present(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Each weight version the rows name, with how many of their trained tokens it sampled
    (``weight_versions``), in the order first named; {} for rows that name none."""
    counts: dict[str, int] = {}
    for row in rows:
        trained = set(positions_to_check(row))
        for span in row.get("weight_versions") or []:
            version = span.get("version")
            if version is None:
                continue
            span_positions = range(int(span["start"]), int(span["end"]))
            counts[str(version)] = counts.get(str(version), 0) + len(
                trained.intersection(span_positions)
            )
    return counts


def describe_versions(counts: Mapping[str, int], shown: int = 12) -> str:
    """``v0 (812 tokens), v1 (790 tokens), ...``: the versions and their trained tokens."""
    parts = [f"{v} ({n} token{'s' if n != 1 else ''})" for v, n in list(counts.items())[:shown]]
    if len(counts) > shown:
        parts.append(f"and {len(counts) - shown} more")
    return ", ".join(parts)


def score_positions(model: Any, input_ids: Sequence[int], positions: Sequence[int]) -> list[float]:
    """log p(input_ids[i] | input_ids[:i]) for each i in ``positions``, by one forward pass of
    ``model`` (a transformers causal LM): hidden states for the whole row, the output layer only
    at the positions before those scored."""
    import torch

    if not positions:
        return []
    with torch.no_grad():
        ids = torch.tensor([list(input_ids)], dtype=torch.long)
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0]
        before = torch.tensor([p - 1 for p in positions], dtype=torch.long)
        logits = model.get_output_embeddings()(hidden[before]).float()
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor([input_ids[p] for p in positions], dtype=torch.long)
        return [float(x) for x in logprobs.gather(1, targets[:, None])[:, 0]]


def check_rows(model: Any, rows: Iterable[Mapping[str, Any]], version: str | None = None) -> Report:
    """Compare ``model``'s logprobs with each row's on the positions it trains."""
    report = Report()
    for row in rows:
        positions = positions_to_check(row, version)
        if not positions:
            report.skipped += 1
            continue
        ours = score_positions(model, row["input_ids"], positions)
        diffs = [abs(ours[k] - float(row["logprobs"][p])) for k, p in enumerate(positions)]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        report.rows.append(
            RowCheck(
                session_id=str(row.get("session_id")),
                thread_id=str(row.get("thread_id")),
                tokens=len(positions),
                max_diff=diffs[worst],
                worst_position=positions[worst],
            )
        )
    return report


def load_model(model_dir: str | Path) -> Any:
    """The model in float32, in eval mode, with the CPU attention of
    ``capture.train.cpu_attention`` (long rows score in seconds)."""
    import torch
    from transformers import AutoModelForCausalLM

    from capture.train.cpu_attention import use_cpu_attention

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return use_cpu_attention(model)


def format_report(report: Report, tolerance: float, version: str | None = None) -> str:
    lines = [
        f"rows checked: {len(report.rows)} (skipped: {report.skipped}, no trained token"
        f"{' of this version' if version else ''})",
        f"tokens compared: {report.tokens}",
        f"max |diff|: {report.max_diff:.3g} (importance ratio {math.exp(report.max_diff):.6f}; "
        f"tolerance {tolerance:g})",
    ]
    if report.rows:
        lines.append("worst rows:")
        lines += [
            f"  {r.max_diff:.3g}  session {r.session_id} thread {r.thread_id}: {r.tokens} tokens, "
            f"worst at position {r.worst_position}"
            for r in report.worst()
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m capture.train.check_logprobs",
        description="Compare an HF model's logprobs with the thread rows' (float32 forward).",
    )
    parser.add_argument("out", help="OUT (agenttap_out), OUT/threads, or one thread shard")
    parser.add_argument("--model", required=True, help="the weights that sampled the rows")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    parser.add_argument(
        "--version", default=None, help="check only tokens this weight version sampled"
    )
    parser.add_argument("--session", default=None, help="check only this session's rows")
    args = parser.parse_args(argv)
    columns = ["session_id", "thread_id", "input_ids", "loss_mask", "logprobs", "weight_versions"]
    try:
        rows = load_threads(args.out, columns=columns, rewards=False)
    except Exception as exc:  # noqa: BLE001 - a shard the reader cannot read: say which
        print(f"check_logprobs: cannot read the rows under {args.out}: {exc}", file=sys.stderr)
        return 2
    if args.session is not None:
        rows = [r for r in rows if r.get("session_id") == args.session]
    if not rows:
        print(f"check_logprobs: no thread rows under {args.out}", file=sys.stderr)
        return 2
    versions = versions_present(rows)
    if args.version is not None and not versions.get(args.version):
        print(
            f"check_logprobs: no trained token under {args.out} was sampled by weight version "
            f"{args.version!r}; "
            + (
                f"the rows name {len(versions)}: {describe_versions(versions)}"
                if versions
                else "the rows name no weight version (weight_versions is empty: no "
                "version was set when they were sampled); leave out --version"
            ),
            file=sys.stderr,
        )
        return 2
    several = args.version is None and len(versions) > 1
    if several:
        # One --model holds one set of weights: tokens other versions sampled will not agree.
        print(
            f"note: these rows were sampled by {len(versions)} weight versions: "
            f"{describe_versions(versions)}. --model holds one of them: check each with "
            f"--version V and that version's weights (e.g. --version {next(iter(versions))})",
            file=sys.stderr,
        )
    report = check_rows(load_model(args.model), rows, args.version)
    print(format_report(report, args.tolerance, args.version))
    if report.max_diff > args.tolerance:
        print(
            f"FAIL: max |diff| {report.max_diff:.3g} > {args.tolerance:g}: these weights did not "
            "sample these rows (or were loaded in another dtype)"
            + (
                f"; the rows hold {len(versions)} weight versions ({describe_versions(versions)}): "
                "pass --version V with the weights of version V"
                if several
                else ""
            ),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
