"""Does the trainer's own forward agree with the rows? ``python -m capture.train.check_logprobs``.

    .venv-train/bin/python -m capture.train.check_logprobs OUT --model DIR [--tolerance 1e-3]

For every thread row under OUT (``capture.storage.reader.load_threads``: OUT, OUT/threads or one
shard), the HF transformers model in DIR (float32) scores the row's ``input_ids`` in one forward
pass, and on every token the row trains (``loss_mask`` 1) its log-probability is compared with
the row's ``logprobs`` (what the policy sampled it with). Printed: rows checked, tokens
compared, max |diff| (and its importance ratio, exp(max |diff|)), the worst rows. Exits 1 when
max |diff| is over ``--tolerance``: the trainer would not be training the policy that sampled
the rows (other weights, another dtype, a different model, or tokens the rows got wrong).

DIR must hold the weights that sampled the rows. After weight updates, rows sampled under
several versions are checked span by span against the weights their ``weight_versions`` name:

    ... check_logprobs OUT --model DIR                  DIR holds one folder per version
                                                        (DIR/step-1, DIR/step-2, ...)
    ... check_logprobs OUT --models step-1=A,step-2=B   the folder of each version named
    ... check_logprobs OUT --model DIR --version V      only the tokens version V sampled

Each version's tokens are scored by that version's weights (one model loaded at a time), so a
policy that served other weights than the label its rows carry (a mixed policy: rows labelled
``2`` whose tokens version 1's weights sampled) fails, naming the version and its worst rows.
A version the rows name with no folder given is an error naming it (and the folders there are);
DIR holding one model over rows of several versions is checked as it is, with a note naming the
versions and the flags. Trained tokens that name no version are counted, not checked, when the
weights are given per version. Only the positions scored are put through the output layer, so a
13k-token row of a 150k-word vocabulary needs no 8 GB of logits.
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
from capture.storage.row_rules import ordered_versions

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
    (``weight_versions``), oldest first (``capture.storage.row_rules.version_key``); {} for
    rows that name none."""
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
    return {v: counts[v] for v in ordered_versions(counts)}


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


class WeightsError(ValueError):
    """The weights given do not cover the rows' versions; the message names the fix."""


def is_model_dir(path: Path) -> bool:
    """Whether ``path`` holds a transformers model (its ``config.json``)."""
    return (path / "config.json").is_file()


def looks_local(name: str) -> bool:
    """Whether ``name`` can only mean a path here (absolute, relative with ``.``, ``~``, or
    more parts than a hub id's ``namespace/name``), not a model id from_pretrained fetches."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or name.endswith("/")


def parse_models(spec: str) -> dict[str, Path]:
    """``--models VERSION=DIR,VERSION=DIR`` as {version: folder}."""
    mapping: dict[str, Path] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        version, eq, folder = part.partition("=")
        if not eq or not version.strip() or not folder.strip():
            raise WeightsError(
                f"--models takes VERSION=DIR pairs separated by commas (e.g. "
                f"--models step-1=weights/step-1,step-2=weights/step-2); {part!r} is not one"
            )
        if version.strip() in mapping:
            raise WeightsError(f"--models names weight version {version.strip()!r} twice")
        mapping[version.strip()] = Path(folder.strip())
    if not mapping:
        raise WeightsError("--models is empty: give VERSION=DIR pairs separated by commas")
    return mapping


def weights_plan(
    model: str | None,
    models: str | None,
    versions: Mapping[str, int],
    only: str | None = None,
) -> tuple[list[tuple[str | None, Path]], bool]:
    """Which weights score which tokens: [(version, folder)] (version None: every trained token,
    by the one model given), and whether the weights were given per version. ``versions``: the
    rows' (``versions_present``); ``only``: ``--version``. WeightsError names what is missing."""
    if (model is None) == (models is None):
        raise WeightsError(
            "give the weights that sampled the rows: --model DIR (one model, or a folder of one "
            "folder per weight version) or --models VERSION=DIR,..."
        )
    if model is not None and not Path(model).exists() and looks_local(model):
        raise WeightsError(
            f"--model {model}: no such folder; give the folder save_pretrained wrote (it holds "
            f"config.json), or a folder holding one such folder per weight version"
        )
    if model is not None and (is_model_dir(Path(model)) or not Path(model).is_dir()):
        # One model (or what from_pretrained takes that is no folder here: a hub id).
        return [(only, Path(model))], False
    wanted = [only] if only is not None else list(versions)
    if models is not None:
        given = parse_models(models)
        where = "--models"
    else:
        assert model is not None
        root = Path(model)
        given = {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and is_model_dir(p)}
        if not given:
            raise WeightsError(
                f"--model {model} holds no model (no config.json) and no folder of one per "
                f"weight version: give the weights' folder (save_pretrained's), or a folder "
                f"holding one such folder per version, named as the rows name them"
            )
        where = f"--model {model} (its folders: {', '.join(given)})"
    if not wanted:
        raise WeightsError(
            f"the rows name no weight version (weight_versions is empty: none was set when "
            f"they were sampled), so {where} maps nothing to them: give the one model that "
            f"sampled them, --model DIR"
        )
    missing = [v for v in wanted if v not in given]
    if missing:
        named = describe_versions({v: versions.get(v, 0) for v in missing})
        raise WeightsError(
            f"no weights for weight version{'s' if len(missing) > 1 else ''} {named} in "
            f"{where}; the rows name {describe_versions(versions)}. Give each version's weights "
            f"(a folder named after it under --model DIR, or VERSION=DIR in --models), or check "
            f"one version alone with --version V"
        )
    for version in wanted:
        if not is_model_dir(given[version]):
            raise WeightsError(
                f"{given[version]} (weight version {version!r}) holds no model: no config.json"
            )
    return [(version, given[version]) for version in wanted], True


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


def unlabelled_tokens(rows: Iterable[Mapping[str, Any]]) -> int:
    """Trained tokens (``positions_to_check``) that no span of ``weight_versions`` names."""
    count = 0
    for row in rows:
        named: set[int] = set()
        for span in row.get("weight_versions") or []:
            if span.get("version") is not None:
                named.update(range(int(span["start"]), int(span["end"])))
        count += sum(1 for p in positions_to_check(row) if p not in named)
    return count


def check_versions(
    rows: Sequence[Mapping[str, Any]], plan: Sequence[tuple[str | None, Path]], tolerance: float
) -> int:
    """Each version's tokens against that version's weights (one model loaded at a time);
    the exit code: 1 where a version's tokens are past ``tolerance`` under its weights."""
    failed: list[tuple[str | None, Path, Report]] = []
    for version, folder in plan:
        report = check_rows(load_model(folder), rows, version)
        print(f"weight version {version!r}, weights {folder}:")
        print(
            "\n".join(
                "  " + line for line in format_report(report, tolerance, version).splitlines()
            )
        )
        if report.max_diff > tolerance:
            failed.append((version, folder, report))
    unlabelled = unlabelled_tokens(rows)
    if unlabelled:
        print(
            f"note: {unlabelled} trained token{'s' if unlabelled != 1 else ''} name no weight "
            f"version (weight_versions): not checked; check them with --model and the one model "
            f"that sampled them",
            file=sys.stderr,
        )
    for version, folder, report in failed:
        worst = report.worst(1)[0]
        print(
            f"FAIL: weight version {version!r}: max |diff| {report.max_diff:.3g} > {tolerance:g} "
            f"under the weights in {folder} (worst: session {worst.session_id} thread "
            f"{worst.thread_id}, position {worst.worst_position}): these weights did not sample "
            f"the tokens the rows label {version!r}; the policy served other weights under that "
            f"label (a mixed policy), or {folder} does not hold version {version!r}",
            file=sys.stderr,
        )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m capture.train.check_logprobs",
        description="Compare an HF model's logprobs with the thread rows' (float32 forward).",
    )
    parser.add_argument("out", help="OUT (agenttap_out), OUT/threads, or one thread shard")
    parser.add_argument(
        "--model",
        default=None,
        help="the weights that sampled the rows, or a folder holding one folder of weights per "
        "weight version, named as the rows' weight_versions name them",
    )
    parser.add_argument(
        "--models",
        default=None,
        metavar="VERSION=DIR,...",
        help="the weights of each weight version the rows name",
    )
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
    try:
        plan, per_version = weights_plan(args.model, args.models, versions, args.version)
    except WeightsError as exc:
        print(f"check_logprobs: {exc}", file=sys.stderr)
        return 2
    if per_version:
        return check_versions(rows, plan, args.tolerance)
    several = args.version is None and len(versions) > 1
    if several:
        # One --model holds one set of weights: tokens other versions sampled will not agree.
        print(
            f"note: these rows were sampled by {len(versions)} weight versions: "
            f"{describe_versions(versions)}. --model holds one of them: check each with "
            f"--version V and that version's weights (e.g. --version {next(iter(versions))}), "
            f"or all at once: --model DIR holding one folder per version (DIR/"
            f"{next(iter(versions))}, ...) or --models {next(iter(versions))}=DIR,...",
            file=sys.stderr,
        )
    report = check_rows(load_model(plan[0][1]), rows, args.version)
    print(format_report(report, args.tolerance, args.version))
    if report.max_diff > args.tolerance:
        print(
            f"FAIL: max |diff| {report.max_diff:.3g} > {args.tolerance:g}: these weights did not "
            "sample these rows (or were loaded in another dtype)"
            + (
                f"; the rows hold {len(versions)} weight versions ({describe_versions(versions)}): "
                "pass --version V with the weights of version V, or every version's weights "
                "(--model DIR of one folder per version, or --models VERSION=DIR,...)"
                if several
                else ""
            ),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
