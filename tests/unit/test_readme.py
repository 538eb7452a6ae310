"""The README and docs/*.md are true: every command in their code blocks is one a test runs or
this file checks (the script, module, option, flag, variable, route or CLI it names exists and
takes what the page gives it); every Python block compiles and imports what exists; docs/OPTIONS.md
is what scripts/options_doc.py generates from the code now; docs/API.md's route table is every
route. A command of a kind nobody checks fails here: add its check. The README stays a front page
(under 250 lines) whose links all lead somewhere."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from capture.control.banner import export_line
from capture.control.endpoints import DUMMY_KEYS, Endpoints
from capture.control.openapi import openapi_spec
from capture.options import all_options

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TEXTS = {str(p.relative_to(REPO)): p.read_text() for p in PAGES}
# (page, language, body) of every fenced block of every page.
BLOCKS = [
    (page, lang, body)
    for page, text in TEXTS.items()
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S)
]

# Variables the pages export, beyond a session's env: each is read by a client the tests drive.
CLIENT_VARIABLES = {"CODEX_HOME", "GEMINI_CLI_TRUST_WORKSPACE"}
# mini-swe-agent's own switches (tests/e2e/clis/test_mini_swe_agent.py sets each).
CLIENT_VARIABLES |= {"MSWEA_CONFIGURED", "MSWEA_COST_TRACKING", "LITELLM_LOCAL_MODEL_COST_MAP"}
# OpenHands' own (tests/e2e/clis/test_openhands.py sets each).
CLIENT_VARIABLES |= {"LLM_MODEL", "LLM_API_KEY", "OPENHANDS_SUPPRESS_BANNER"}
# Harbor imports agenttap's environment from it (tests/e2e/clis/test_harbor_terminus.py sets it).
CLIENT_VARIABLES |= {"PYTHONPATH"}
# The line the banner prints for a shell to source (export AGENTTAP_API=... AGENTTAP_TOKEN=...).
BANNER_VARIABLES = {w.split("=", 1)[0] for w in shlex.split(export_line("a", "t", "k", "p"))[1:]}
# Agent CLIs the README runs, and the end-to-end test that runs each the same way.
CLI_TESTS = {
    "claude": "tests/e2e/clis/test_claude_code.py",
    "codex": "tests/e2e/clis/test_codex.py",
    "gemini": "tests/e2e/clis/test_gemini_cli.py",
    "opencode": "tests/e2e/clis/test_opencode.py",
    "mini": "tests/e2e/clis/test_mini_swe_agent.py",
    "openhands": "tests/e2e/clis/test_openhands.py",
    "harbor": "tests/e2e/clis/test_harbor_terminus.py",
}
# Scripts the README runs, and what runs each (CI runs scripts/test.sh, which runs setup.sh).
SCRIPT_RUNNERS = {
    "scripts/setup.sh": ".ci/run",
    "scripts/test.sh": ".ci/run",
    "scripts/run_proxy.sh": "tests/e2e/policy/test_run_proxy.py",
}
# What the README runs in the trainer's environment, and the test that runs each.
TRAIN_RUNNERS = {
    "examples/train_grpo.py": "tests/e2e/rollouts/test_train_example.py",
    "capture/train/check_logprobs.py": "tests/e2e/rollouts/test_train_trl_loop.py",
}


def commands() -> list[tuple[str, str]]:
    """(page, command line) of every bash block (continuations joined, comments cut)."""
    out = []
    for page, lang, body in BLOCKS:
        if lang not in ("bash", "sh"):
            continue
        joined = re.sub(r"\\\n\s*", " ", body)
        # A quoted JSON body may span lines: join lines inside an open quote. Comments are cut
        # first: an apostrophe in one ("the proxy's CA") opens no quote.
        lines: list[str] = []
        for line in joined.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if lines and lines[-1].count("'") % 2 == 1:
                lines[-1] += " " + line
            elif line and not line.startswith("#"):
                lines.append(line)
        out += [(page, line) for line in lines]
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
    assert (method, path) in route_methods(), f"curl {method} {path}: no such route"
    if "-d" in words:
        import json

        json.loads(words[words.index("-d") + 1])  # the body the page shows is JSON


def check(line: str) -> None:
    words = shlex.split(line.replace("...", "ARGS"))
    head = words[0]
    if re.fullmatch(r"[A-Z][A-Z0-9_]*=\S*", head):
        # A variable set for one command: the script it runs reads it; then the command itself.
        name, script = head.split("=", 1)[0], REPO / words[1]
        assert script.is_file() and name in script.read_text(), f"{words[1]} never reads {name}"
        check(shlex.join(words[1:]))
        return
    if head == "export":
        env_names = set(Endpoints("http://a", "http://p", "/ca", "/bundle").env("S"))
        for assignment in words[1:]:
            if "=" not in assignment:
                continue  # the rest of a value with spaces: CODEX_HOME=$(mktemp -d)
            name = assignment.split("=", 1)[0]
            known = env_names | set(DUMMY_KEYS) | CLIENT_VARIABLES | BANNER_VARIABLES
            assert name in known, (
                f"exports {name}, which no session env or banner line holds and no client reads"
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
                assert name in names, f"sets {name}, which is no agenttap option"
        return
    if head == ".venv-train/bin/python":
        # The trainer's environment (torch; none here): the script or module exists, a test
        # runs it, and the flags shown are its own.
        target = words[1] if words[1] != "-m" else words[2].replace(".", "/") + ".py"
        runner = TRAIN_RUNNERS[target]
        assert Path(target).stem in (REPO / runner).read_text(), f"{runner} does not run {target}"
        source = (REPO / target).read_text()
        for w in words[2:]:
            if w.startswith("--"):
                assert f'"{w}"' in source, f"{target} takes no {w}"
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
            assert flag in test, f"runs {head} with {flag}, which {CLI_TESTS[head]} never does"
        return
    if head == "python" and words[1] == "my_agent.py":
        return  # the user's own program: any client, configured by the exports above
    pytest.fail(f"command nobody checks: {line!r} (run it in a test or check it here)")


@pytest.mark.parametrize(("page", "line"), commands(), ids=lambda v: v[:60])
def test_every_command_is_checked(page: str, line: str) -> None:
    try:
        check(line)
    except AssertionError as e:
        raise AssertionError(f"{page}: {e}") from e


def test_the_readme_and_the_docs_hold_commands() -> None:
    pages = {page for page, _ in commands()}
    assert {"README.md", "docs/API.md", "docs/PROVIDERS.md", "docs/RUNNING.md"} <= pages


def test_every_python_block_compiles_and_imports_what_exists() -> None:
    blocks = [(page, body) for page, lang, body in BLOCKS if lang == "python"]
    assert {page for page, _ in blocks} >= {"README.md", "docs/API.md", "docs/SHARDS.md"}
    for page, body in blocks:
        compile(body, page, "exec")
        for module, names in re.findall(r"^\s*from ([\w.]+) import ([\w, ]+)", body, re.M):
            mod = importlib.import_module(module)
            for name in (n.strip() for n in names.split(",")):
                assert hasattr(mod, name), f"{page} imports {name} from {module}: no such name"


def test_the_options_doc_is_generated_from_the_code_now() -> None:
    """docs/OPTIONS.md is exactly what scripts/options_doc.py writes from all_options(): a
    changed, added or removed option fails here until the doc is regenerated."""
    done = subprocess.run(
        [sys.executable, "scripts/options_doc.py"], cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == TEXTS["docs/OPTIONS.md"], (
        "docs/OPTIONS.md is stale: run .venv/bin/python scripts/options_doc.py --write"
    )
    table = set(re.findall(r"^\| `(agenttap_\w+)` \|", done.stdout, re.M))
    assert table == {o.name for o in all_options()}


def test_the_route_table_is_every_route() -> None:
    rows = re.findall(r"^\| `((?:GET|POST|DELETE)[^|]*)` \|", TEXTS["docs/API.md"], re.M)
    named: set[tuple[str, str]] = set()
    for cell in rows:
        for part in cell.split("`, `"):
            method, path = part.strip("` ").split(" ", 1)
            path = path.split("?")[0].split("[")[0].replace("{id}", "{id}")
            named.add((method, path))
    spec = route_methods()
    assert named <= spec, named - spec
    missing = {r for r in spec if r not in named and r[1] != "/openapi.json"}
    assert not missing, f"routes docs/API.md's table leaves out: {sorted(missing)}"


def test_every_bench_script_and_test_a_page_names_exists() -> None:
    for page, text in TEXTS.items():
        for name in set(
            re.findall(r"`((?:bench|tests|examples|scripts)/[\w/]+\.(?:py|sh))`", text)
        ):
            assert (REPO / name).is_file(), f"{page} names {name}: no such file"


def test_the_readme_is_a_front_page() -> None:
    """Under 250 lines; the reference lives in docs/, and the README links every page there."""
    readme = TEXTS["README.md"]
    assert len(readme.splitlines()) < 250, "README.md: move reference material to docs/"
    for page in TEXTS:
        if page.startswith("docs/"):
            assert f"]({page})" in readme, f"README.md does not link {page}"


def test_every_relative_link_leads_to_a_file() -> None:
    for page, text in TEXTS.items():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            assert ((REPO / page).parent / target).exists(), f"{page} links {target}: no such file"
