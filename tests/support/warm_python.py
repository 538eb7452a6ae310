"""A script run in a Python that has imported torch already: the weight tests' trainer steps and
HF forwards (tests/support/weights_step.py, hf_score.py) each paid 7-10 s of CPU to import
torch and transformers in a new process, about twenty times a run, on the slowest worker.

One ``WarmPython`` per interpreter (``warm(python)``) stays up for the test process's life and
runs each script as ``python SCRIPT ARGS < STDIN`` would: ``runpy`` as ``__main__``, with its
``sys.argv``, its stdin and its stdout and stderr captured, so a script runs unchanged either
way. Nothing a script leaves behind is shared but what it imported (each seeds its own RNG).

    done = warm(HF_PYTHON).run(SCRIPT, "score", MODEL_DIR, stdin=json.dumps(...))
    done.returncode, done.stdout, done.stderr
"""

from __future__ import annotations

import atexit
import json
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any


class WarmPython:
    """A long-lived ``python warm_python.py`` serving one script run per line of JSON."""

    def __init__(self, python: Path) -> None:
        self.python = python
        self._lock = threading.Lock()
        self._proc = self._start()

    def _start(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [str(self.python), str(Path(__file__).resolve())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def run(
        self, script: Path, *args: str, stdin: str | None = None, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """``python SCRIPT ARGS`` with ``stdin``, in this warm interpreter. Past ``timeout``
        seconds the interpreter is killed and ``subprocess.TimeoutExpired`` raised, as
        ``subprocess.run`` does."""
        request = json.dumps({"script": str(script), "argv": list(args), "stdin": stdin or ""})
        with self._lock:
            if self._proc.poll() is not None:  # it died (a script's crash): a fresh one
                self._proc = self._start()
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.write(request + "\n")
            self._proc.stdin.flush()
            # One answer per request, written whole: nothing is left buffered between runs.
            ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
            if not ready:
                self._proc.kill()
                self._proc.wait()
                raise subprocess.TimeoutExpired([str(script), *args], timeout)
            line = self._proc.stdout.readline()
        if not line:
            return subprocess.CompletedProcess([script, *args], 1, "", "the warm Python died")
        done = json.loads(line)
        return subprocess.CompletedProcess(
            [script, *args], done["returncode"], done["stdout"], done["stderr"]
        )

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()


_WARM: dict[Path, WarmPython] = {}
_WARM_LOCK = threading.Lock()


def warm(python: Path) -> WarmPython:
    """This test process's warm interpreter ``python`` (started on first use)."""
    with _WARM_LOCK:
        if python not in _WARM:
            _WARM[python] = WarmPython(python)
        return _WARM[python]


@atexit.register
def _close_all() -> None:
    for interpreter in _WARM.values():
        interpreter.close()


def _serve() -> None:
    """The warm side: one request per line on stdin, one answer per line on stdout."""
    import contextlib
    import io
    import runpy
    import traceback

    answers = sys.stdout
    for line in sys.stdin:
        request: dict[str, Any] = json.loads(line)
        out, err = io.StringIO(), io.StringIO()
        code = 0
        sys.argv = [request["script"], *request["argv"]]
        sys.stdin = io.StringIO(request["stdin"])
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(request["script"], run_name="__main__")
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = 1
        answers.write(json.dumps({"returncode": code, "stdout": out.getvalue(),
                                  "stderr": err.getvalue()}) + "\n")  # fmt: skip
        answers.flush()


if __name__ == "__main__":
    _serve()
