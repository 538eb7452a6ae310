"""The README is true: every command in its code blocks is one a test runs or this file checks
(the script, module, option, flag, variable, route or CLI it names exists and takes what the
README gives it); every Python block compiles and imports what exists; the option table and
the route table match the code. A command of a kind nobody checks fails here: add its check."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from capture.control_api import DUMMY_KEYS, Endpoints
from capture.openapi import openapi_spec
from capture.options import all_options

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, re.S)

# Variables the README exports, beyond a session's env: each is read by a client the tests drive.
CLIENT_VARIABLES = {"CODEX_HOME", "GEMINI_CLI_TRUST_WORKSPACE"}
# Agent CLIs the README runs, and the end-to-end test that runs each the same way.
CLI_TESTS = {
    "claude": "tests/e2e/test_claude_code.py",
    "codex": "tests/e2e/test_codex.py",
    "gemini": "tests/e2e/test_gemini_cli.py",
}
# Scripts the README runs, and what runs each (CI runs scripts/test.sh, which runs setup.sh).
SCRIPT_RUNNERS = {
    "scripts/setup.sh": ".ci/run",
    "scripts/test.sh": ".ci/run",
    "scripts/run_proxy.sh": "tests/e2e/test_run_proxy.py",
}


def commands() -> list[str]:
    """Every command line of the README's bash blocks (continuations joined, comments cut)."""
    out = []
    for lang, body in BLOCKS:
        if lang not in ("bash", "sh"):
            continue
        joined = re.sub(r"\\\n\s*", " ", body)
        # A quoted JSON body may span lines: join lines inside an open quote.
        lines: list[str] = []
        for line in joined.splitlines():
            if lines and lines[-1].count("'") % 2 == 1:
                lines[-1] += " " + line.strip()
            else:
                lines.append(line)
        for line in lines:
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def run_proxy_flags() -> set[str]:
    text = (REPO / "scripts" / "run_proxy.sh").read_text()
    return set(re.findall(r"^\s+(--[a-z-]+)\)", text, re.M))


def help_text(*argv: str) -> str:
    done = subprocess.run(
        [sys.executable, *argv, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def route_methods() -> set[tuple[str, str]]:
    spec = openapi_spec("http://x")
    return {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}


def check_curl(words: list[str]) -> None:
    method = "POST" if "-d" in words else "GET"
    if "-X" in words:
        method = words[words.index("-X") + 1]
    url = next(w for w in words if "$AGENTTAP_API" in w or "agenttap.local" in w)
    path = re.sub(r"^.*(\$AGENTTAP_API|agenttap\.local)", "", url).split("?")[0]
    assert (method, path) in route_methods(), f"README: curl {method} {path}: no such route"
    if "-d" in words:
        import json

        json.loads(words[words.index("-d") + 1])  # the body the README shows is JSON


def check(line: str) -> None:
    words = shlex.split(line.replace("...", "ARGS"))
    head = words[0]
    if head == "export":
        env_names = set(Endpoints("http://a", "http://p", "/ca", "/bundle").env("S"))
        for assignment in words[1:]:
            name = assignment.split("=", 1)[0]
            assert name in env_names | set(DUMMY_KEYS) | CLIENT_VARIABLES, (
                f"README exports {name}, which no session env holds and no client reads"
            )
        return
    if head in SCRIPT_RUNNERS:
        assert os.access(REPO / head, os.X_OK), f"{head} is not executable"
        assert (REPO / SCRIPT_RUNNERS[head]).is_file()
        if head == "scripts/run_proxy.sh":
            given = {
                w
                for w in words[1 : words.index("--") if "--" in words else None]
                if w.startswith("--")
            }
            assert given <= run_proxy_flags(), f"run_proxy.sh takes no {given - run_proxy_flags()}"
        return
    if head == ".venv/bin/mitmdump":
        assert words[1:3] == ["-s", "addons/capture.py"]
        names = {o.name for o in all_options()}
        for i, w in enumerate(words):
            if w == "--set":
                name = words[i + 1].split("=", 1)[0]
                assert name in names, f"README sets {name}, which is no agenttap option"
        return
    if head == ".venv/bin/python" and words[1] == "-m":
        module = words[2]
        importlib.import_module(module)
        text = help_text("-m", module)
        for w in words[3:]:
            if w.startswith("--"):
                assert w in text, f"python -m {module} takes no {w}"
        return
    if head == "curl":
        check_curl(words)
        return
    if head in CLI_TESTS:
        test = (REPO / CLI_TESTS[head]).read_text()
        for flag in (w for w in words[1:] if w.startswith("-")):
            assert flag in test, (
                f"README runs {head} with {flag}, which {CLI_TESTS[head]} never does"
            )
        return
    if head == "python" and words[1] == "my_agent.py":
        return  # the user's own program: any client, configured by the exports above
    pytest.fail(f"README command nobody checks: {line!r} (run it in a test or check it here)")


@pytest.mark.parametrize("line", commands())
def test_every_readme_command_is_checked(line: str) -> None:
    check(line)


def test_every_python_block_compiles_and_imports_what_exists() -> None:
    blocks = [body for lang, body in BLOCKS if lang == "python"]
    assert blocks
    for body in blocks:
        compile(body, "README.md", "exec")
        for module, names in re.findall(r"^\s*from ([\w.]+) import ([\w, ]+)", body, re.M):
            mod = importlib.import_module(module)
            for name in (n.strip() for n in names.split(",")):
                assert hasattr(mod, name), f"README imports {name} from {module}: no such name"


def test_the_option_table_is_every_option() -> None:
    table = set(re.findall(r"^\| `(agenttap_\w+)` \|", README, re.M))
    assert table == {o.name for o in all_options()}


def test_the_route_table_is_every_route() -> None:
    rows = re.findall(r"^\| `((?:GET|POST|DELETE)[^|]*)` \|", README, re.M)
    named: set[tuple[str, str]] = set()
    for cell in rows:
        for part in cell.split("`, `"):
            method, path = part.strip("` ").split(" ", 1)
            path = path.split("?")[0].split("[")[0].replace("{id}", "{id}")
            named.add((method, path))
    spec = route_methods()
    assert named <= spec, named - spec
    missing = {r for r in spec if r not in named and r[1] != "/openapi.json"}
    assert not missing, f"routes the README's table leaves out: {sorted(missing)}"


def test_every_bench_script_the_readme_names_exists() -> None:
    for name in set(re.findall(r"`(bench/\w+\.py)`", README)):
        assert (REPO / name).is_file(), name
    for name in set(re.findall(r"`(tests/[\w/]+\.py)`", README)):
        assert (REPO / name).is_file(), name
