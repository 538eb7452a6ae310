"""bench/images.py's pure parts: the starts' cold and warm numbers, its three tables, the
/proc readers, the rows it measures and its flags. No podman, no sandbox."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from bench.images import (
    ECHO,
    Crowd,
    Starts,
    crowd_table,
    kib_field,
    mem_available,
    parse,
    phase_table,
    rows_for,
    start_table,
    usable_path,
)


def test_cold_is_the_first_start_and_warm_the_median_of_the_rest() -> None:
    starts = Starts([2.0, 0.5, 0.9, 0.4])
    assert starts.cold == 2.0
    assert starts.warm == 0.5  # the cold one left out: the median of 0.5, 0.9, 0.4
    assert Starts([1.0, 0.3, 0.5]).warm == pytest.approx(0.4)  # interpolated
    assert math.isnan(Starts().cold) and math.isnan(Starts([1.0]).warm)
    failed = Starts([1.0, 0.5], failed=True)
    assert math.isnan(failed.cold) and math.isnan(failed.warm)


def test_the_start_table_sets_podman_beside_bwrap() -> None:
    rows = {
        "codex": {"podman": Starts([1.2, 0.6, 0.7, 0.65]), "bwrap": Starts([0.5, 0.2, 0.3, 0.25])},
        "gemini": {"podman": Starts(failed=True), "bwrap": Starts([4.0, 2.0])},
    }
    header, rule, codex, gemini = start_table(rows)
    assert header.count("|") == rule.count("|") == codex.count("|") == gemini.count("|")
    assert codex == "| codex | 1,200 | 650 | 500 | 250 | 2.6x | 400 |"
    assert gemini == "| gemini | failed | failed | 4,000 | 2,000 | - | - |"


def test_the_phase_table_gives_cold_and_warm_and_leaves_out_a_failed_row() -> None:
    podman = Starts([1.0, 0.5, 0.6])
    podman.phases = {
        "create": [0.3, 0.1, 0.2],
        "init": [0.4, 0.2, 0.2],
        "first_line": [0.3, 0.2, 0.2],
        "remove": [0.5, 0.1, 0.3],
    }
    rows = {"echo": {"podman": podman}, "gemini": {"podman": Starts(failed=True)}}
    lines = phase_table(rows)
    assert lines[2:] == ["| echo | 300 / 150 | 400 / 200 | 300 / 200 | 500 / 200 |"]


def test_the_crowd_table_sums_the_peaks_and_compares_the_wall_with_bwrap() -> None:
    mib = 1 << 20
    crowds = [
        Crowd("bwrap", 2.5, 16, 16, [6 * mib] * 16, 100 * mib),
        Crowd("podman", 10.0, 15, 16, [10 * mib] * 16, 600 * mib, helpers_pss=400 * mib),
    ]
    _, _, bwrap, podman = crowd_table(crowds)
    assert bwrap == "| bwrap | 16/16 | 2.50 | 0.50 | 1.0x | 96 | 6.0 | 0 | 100 |"
    assert podman == "| podman | 15/16 | 10.00 | 8.00 | 4.0x | 160 | 10.0 | 400 | 600 |"


def test_proc_fields_are_read_in_bytes() -> None:
    meminfo = "MemTotal:       24683520 kB\nMemFree:  100 kB\nMemAvailable:   21250000 kB\n"
    assert mem_available(meminfo) == 21250000 * 1024
    with pytest.raises(ValueError, match="MemAvailable"):
        mem_available("MemTotal: 1 kB\n")
    rollup = "Rss:                5000 kB\nPss:                1234 kB\nPss_Anon: 10 kB\n"
    assert kib_field(rollup, "Pss") == 1234 * 1024
    assert kib_field(rollup, "Swap") == 0.0


def test_a_program_behind_a_linked_folder_keeps_its_own_name(tmp_path: Path) -> None:
    real = tmp_path / "main" / ".venv" / "bin"
    real.mkdir(parents=True)
    (real / "python3").write_text("")
    (real / "python").symlink_to("python3")  # a venv's python: a link the venv is found by
    (tmp_path / "worktree").mkdir()
    os.symlink(tmp_path / "main" / ".venv", tmp_path / "worktree" / ".venv")
    linked = tmp_path / "worktree" / ".venv" / "bin" / "python"
    assert usable_path(str(linked)) == str(real / "python")


def test_rows_start_with_echo_and_put_each_variant_after_its_agent() -> None:
    labels = [label for label, _, _ in rows_for(["codex", "gemini"])]
    assert labels == [ECHO, "codex", "gemini", "gemini, GEMINI_CLI_NO_RELAUNCH"]
    assert rows_for([])[0] == (ECHO, ECHO, {})
    variant = rows_for(["gemini"])[-1]
    assert variant[1] == "gemini" and variant[2] == {"GEMINI_CLI_NO_RELAUNCH": "true"}


def test_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["--reps", "5", "--agents", "codex,terminus-2", "--concurrency", "0"])
    assert (args.reps, args.agents, args.concurrency) == (5, ["codex", "terminus-2"], 0)
    assert parse(["--agents", ""]).agents == []
    assert "openhands" in parse([]).agents
    with pytest.raises(SystemExit):
        parse(["--agents", "codex,aider"])
    assert "unknown agents ['aider']" in capsys.readouterr().err
