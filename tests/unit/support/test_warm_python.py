"""tests/support/warm_python.py runs a script as a new ``python SCRIPT ARGS < STDIN`` would:
its argv, stdin, stdout, stderr and exit status, one run after another in one interpreter, and
its timeout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.warm_python import WarmPython

SCRIPT = """
import json, os, sys
if __name__ == "__main__":
    data = sys.stdin.read()
    print(json.dumps({"argv": sys.argv[1:], "stdin": data, "pid": os.getpid()}))
    print("to stderr", file=sys.stderr)
    if sys.argv[1:] == ["fail"]:
        sys.exit(3)
    if sys.argv[1:] == ["raise"]:
        raise ValueError("broken on purpose")
    if sys.argv[1:] == ["hang"]:
        import time
        time.sleep(60)
"""


def test_a_script_runs_as_in_a_new_process_and_the_interpreter_is_reused(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    warm = WarmPython(Path(sys.executable))
    try:
        first = warm.run(script, "a", "b", stdin="input")
        assert first.returncode == 0 and first.stderr == "to stderr\n", first
        seen = json.loads(first.stdout)
        assert seen["argv"] == ["a", "b"] and seen["stdin"] == "input"
        again = warm.run(script)
        assert json.loads(again.stdout) == {"argv": [], "stdin": "", "pid": seen["pid"]}
        failed = warm.run(script, "fail")
        assert failed.returncode == 3
        raised = warm.run(script, "raise")
        assert raised.returncode == 1 and "ValueError: broken on purpose" in raised.stderr
        # Still serving after both.
        assert warm.run(script, "c").returncode == 0
        # A script that hangs is killed at its timeout, as subprocess.run would; the next run
        # gets a fresh interpreter.
        with pytest.raises(subprocess.TimeoutExpired):
            warm.run(script, "hang", timeout=1)
        assert warm.run(script, "d").returncode == 0
    finally:
        warm.close()
