"""Rewards the agent cannot write (issue 47): every attack measured against a pytest verifier
that read its exit status, first shown to work against that verifier, then run against
``"keep"`` (the grade on a fresh copy of the seed) and the built-in pytest verifier; and the
reward channel (stdout only, one number inside ``reward_range``, ``$AGENTTAP_REWARD_FILE``).
Each rollout has the honest agent as its control: it must still score 1.0.

Real parts: agenttap under mitmdump (the launcher), bwrap sandboxes for agents and verifiers,
pytest as the verifier; the policy is the stub (what it answers does not matter here).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from capture.client.launcher import AgentTap
from tests.support import reward_attacker

ATTACKER = Path(reward_attacker.__file__)
# This venv's Python by its real path: the sandbox shows the agent's install where it really is.
PYTHON = str(Path(sys.prefix).resolve() / "bin" / "python")
ATTACKS = [
    "honest", "conftest", "pytest.ini", "pyproject.toml", "setup.cfg", "tox.ini", "os_exit",
    "plugin", "pyc",
]  # fmt: skip
FILE_ATTACKS = {"conftest", "pytest.ini", "pyproject.toml", "setup.cfg", "tox.ini", "pyc"}
TESTS = "from solution import add\n\ndef test_add():\n    assert add(1, 2) == 3\n\n" + (
    "def test_add_negative():\n    assert add(-1, 1) == 0\n"
)
# The seed's own conftest puts the workdir on sys.path (the tests import solution.py).
SEED_CONFTEST = (
    "import pathlib, sys\n\nsys.path.insert(0, str(pathlib.Path(__file__).parents[1]))\n"
)
# A verifier as written before: pytest's exit status decides.
BY_EXIT_STATUS = [
    PYTHON, "-c",
    "import subprocess, sys\n"
    "status = subprocess.call([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', "
    "'tests'], stdout=2)\n"
    "print(1 if status == 0 else 0)",
]  # fmt: skip
# agenttap_max_rollouts's default: agents running at once.
MAX_AGENTS = 8
NODE_IDS = ["tests/test_solution.py::test_add", "tests/test_solution.py::test_add_negative"]


def make_seed(root: Path) -> Path:
    seed = root / "seed"
    (seed / "tests").mkdir(parents=True)
    (seed / "solution.py").write_text(reward_attacker.WRONG)
    (seed / "tests" / "test_solution.py").write_text(TESTS)
    (seed / "tests" / "conftest.py").write_text(SEED_CONFTEST)
    return seed


def rollout(
    tap: AgentTap, seed: Path, name: str, attacks: list[str], verifier: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Each attack by one agent of a rollout (at most 8 agents run at once: more go in a second
    rollout)."""
    runs = {}
    for start in range(0, len(attacks), MAX_AGENTS):
        batch = attacks[start : start + MAX_AGENTS]
        body = {
            "agent": {"command": [PYTHON, str(ATTACKER)]},
            "prompt": json.dumps(batch), "n": len(batch), "workdir": str(seed),
            "verifier": verifier, "id": f"{name}-{start}",
        }  # fmt: skip
        result = tap.client.request("POST", "/rollouts", body, timeout=None)[0]
        assert result["sandbox"] == "bwrap"
        runs.update({batch[r["index"]]: r for r in result["rollouts"]})
    return runs


def rewards(runs: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    return {name: run["reward"] for name, run in runs.items()}


def test_each_attack_scores_1_against_a_verifier_that_reads_the_exit_status(
    stub_tap: AgentTap, tmp_path: Path
) -> None:
    """The attacks are real: against pytest's exit status (one file restored), each scores
    1.0 with a solution that fails every test."""
    runs = rollout(stub_tap, make_seed(tmp_path), "attacks-before", ATTACKS, {
        "command": BY_EXIT_STATUS, "restore": ["tests/test_solution.py"],
    })  # fmt: skip
    assert rewards(runs) == dict.fromkeys(ATTACKS, 1.0), {k: r["error"] for k, r in runs.items()}


def test_keep_grades_the_seed_with_only_the_agents_kept_files(
    stub_tap: AgentTap, tmp_path: Path
) -> None:
    runs = rollout(stub_tap, make_seed(tmp_path), "attacks-keep", ATTACKS, {
        "command": BY_EXIT_STATUS, "keep": ["solution.py"],
    })  # fmt: skip
    got = rewards(runs)
    assert got["honest"] == 1.0, runs["honest"]
    # What the agent left beside its solution does not exist where the tests run.
    assert {name: got[name] for name in FILE_ATTACKS} == dict.fromkeys(FILE_ATTACKS, 0.0), got
    # Code the tests import runs in the verifier's process: keep cannot stop it, and this
    # verifier believes pytest's exit status. The built-in pytest verifier does not (below).
    assert got["os_exit"] == 1.0 and got["plugin"] == 1.0
    for name in ATTACKS:
        graded = runs[name]["graded"]
        # solution.py is always kept (the seed's own bytes when the agent left it as it was).
        assert graded["kept"] == ["solution.py"], (name, graded)
    left_out = {name: {e["path"] for e in runs[name]["graded"]["left_out"]} for name in ATTACKS}
    assert left_out["conftest"] == {"conftest.py"}
    assert left_out["tox.ini"] == {"tox.ini"}
    assert left_out["pyc"] == {"tests/__pycache__/"}
    assert left_out["honest"] == set()
    # The agent's own copy is untouched: what it made is still there to read.
    assert (Path(runs["conftest"]["workdir"]) / "conftest.py").exists()


def test_the_pytest_verifier_reads_a_junit_report_on_the_seed(
    stub_tap: AgentTap, tmp_path: Path
) -> None:
    runs = rollout(stub_tap, make_seed(tmp_path), "attacks-pytest", ATTACKS, {
        "pytest": NODE_IDS, "python": PYTHON,
    })  # fmt: skip
    got = rewards(runs)
    assert got["honest"] == 1.0, runs["honest"]
    assert runs["honest"]["tests"] == {"passed": NODE_IDS, "failed": [], "missing": []}
    assert {name: got[name] for name in FILE_ATTACKS} == dict.fromkeys(FILE_ATTACKS, 0.0), got
    # os._exit(0) at exit: the report was written before it; both tests failed.
    assert got["os_exit"] == 0.0 and runs["os_exit"]["tests"]["failed"] == NODE_IDS
    # A plugin registered while the tests ran: no reward at all, and it says why.
    assert got["plugin"] is None and runs["plugin"]["status"] == "error"
    assert "a pytest plugin ('forge', _Forge) was registered" in runs["plugin"]["error"]


def test_the_reward_is_read_from_stdout_alone_and_must_be_in_range(
    stub_tap: AgentTap, tmp_path: Path
) -> None:
    """1e30 written at exit without a newline: on stderr it is not read (the harness's own 0
    is the reward); on stdout it is the last line, 1e30, outside [0, 1]: no reward."""
    seed = make_seed(tmp_path)
    check = [PYTHON, "-c", "import sys; sys.path[:0] = ['.']; import solution\n"
             "print(float(solution.add(1, 2) == 3))"]  # fmt: skip
    names = ["honest", "stderr_1e30", "stdout_1e30"]
    runs = rollout(stub_tap, seed, "reward-channel", names, {"command": check, "keep": ["*.py"]})
    assert runs["honest"]["reward"] == 1.0
    assert runs["stderr_1e30"]["reward"] == 0.0, runs["stderr_1e30"]["error"]
    assert runs["stderr_1e30"]["verifier_stderr"].endswith("1e30")
    stdout = runs["stdout_1e30"]
    assert stdout["reward"] is None and stdout["status"] == "error"
    assert 'outside the verifier\'s "reward_range" [0, 1]' in stdout["error"], stdout["error"]


def test_a_verifier_may_write_its_rewards_to_the_reward_file(
    stub_tap: AgentTap, tmp_path: Path
) -> None:
    seed = make_seed(tmp_path)
    write = (
        "import json, os\n"
        "json.dump({'reward': 0.5, 'style': 3.0}, open(os.environ['AGENTTAP_REWARD_FILE'], 'w'))\n"
        "print(1)  # printed, but the file is what counts\n"
    )
    runs = rollout(stub_tap, seed, "reward-file", ["honest"], {
        "command": [PYTHON, "-c", write],
    })  # fmt: skip
    assert runs["honest"]["reward"] == 0.5
    assert runs["honest"]["rewards"] == {"reward": 0.5, "style": 3.0}
