"""Issue 14 item 1's matrix of option mistakes, shared by the two tests that decide it: every
case in-process through mitmproxy's own script loader (``tests/unit/addons/
test_fail_closed_matrix.py``), and one case per source and kind of mistake through a real
mitmdump (``tests/e2e/hostile/test_fail_closed.py``), which shows the in-process verdict is mitmdump's.
One builder, so that both decide the same cases with the same inputs and expected words."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from tests.support.paths import QWEN3

# option -> a value it refuses (None: every text is a valid value for it)
BAD_VALUES: dict[str, str | None] = {
    "agenttap_policy_url": "ftp://policy",
    "agenttap_tokenizer": "/nonexistent/tokenizer",
    "agenttap_out": "{a_file}",
    "agenttap_tool_parser": "nope",
    "agenttap_reasoning_parser": "nope",
    "agenttap_hosts": "api openai com",
    "agenttap_idle_timeout": "soon",
    "agenttap_max_body_bytes": "8MB",
    "agenttap_policy_timeout": "0",
    "agenttap_policy_connections": "-1",
    "agenttap_stream_flush_ms": "20ms",
    "agenttap_replica_max_inflight": "-3",
    "agenttap_replica_queue": "lots",
    "agenttap_session_max_inflight": "-1",
    "agenttap_client_timeout": "1m",
    "agenttap_model_map": "claude-*",
    "agenttap_model_names": None,
    "agenttap_recompute_mismatch_logprobs": "maybe",
    "agenttap_drop_system_blocks": "([",
    "agenttap_responses_stored": "-5",
    "agenttap_responses_websocket": "maybe",
    "agenttap_api_host": "not a host!",
    "agenttap_api_port": "http",
    "agenttap_token": "short",
    "agenttap_token_file": "/nonexistent/token",
    "agenttap_require_session_secret": "maybe",
    "agenttap_sandbox": "docker",
    "agenttap_sandbox_hide": None,
    "agenttap_sandbox_expose": None,
    "agenttap_sandbox_paths": "/workdir",
    "agenttap_rollout_max_connections": "0",
    "agenttap_weights_tolerance": "-0.1",
    "agenttap_weights_check_s": "soon",
    "agenttap_advertise_host": "not a host!",
    "agenttap_max_rollouts": "0",
    "agenttap_rollout_memory_mb": "-5",
    "agenttap_max_staleness": "-1",
    "agenttap_passthrough": "*.openai.com",
    "agenttap_check_policy": "maybe",
    "agenttap_journal_fsync": "sometimes",
}


def test_every_option_is_in_the_matrix() -> None:
    """A new option joins the matrix (collected where it is imported: the in-process test)."""
    from capture.options import all_options

    assert sorted(BAD_VALUES) == sorted(o.name for o in all_options())


class Case(NamedTuple):
    source: str  # "--set" or "yaml" (config.yaml in mitmdump's confdir)
    mistake: str  # "bad value", "no value", "repeated", "misspelled", "a list"
    option: str
    # The --set arguments ("\0"-separated, "--set" included) or the config.yaml text.
    spec: str
    # Words mitmdump's error must hold: the option as the user wrote it, or the problem.
    expected: str


def good_options(stub_url: str, out: Path) -> dict[str, str]:
    """What every case also gives (unless it gets that option wrong): a policy that answers, its
    tokenizer, a folder for shards. Without a mistake, mitmdump starts with these."""
    return {
        "agenttap_policy_url": stub_url,
        "agenttap_tokenizer": str(QWEN3),
        "agenttap_out": str(out),
    }


def cases(a_file: Path) -> list[Case]:
    """Every option x every mistake a user makes with it, from --set and from config.yaml.
    ``a_file``: an existing file (a folder option's bad value)."""
    found = []
    for option, bad in BAD_VALUES.items():
        typo = option.replace("agenttap_", "agenttap_x")
        if bad is not None:
            bad = bad.format(a_file=a_file)
            found.append(Case("--set", "bad value", option, f"--set\0{option}={bad}", option))
            found.append(Case("yaml", "bad value", option, f'{option}: "{bad}"\n', option))
        found.append(
            Case("--set", "no value", option, f"--set\0{option}", f"{option} has no value")
        )
        found.append(
            Case("--set", "repeated", option,
                 f"--set\0{option}=a\0--set\0{option}=b", f"{option} given more than once")
        )  # fmt: skip
        found.append(Case("--set", "misspelled", option, f"--set\0{typo}=1", typo))
        found.append(Case("yaml", "no value", option, f"{option}:\n", f"{option} has no value"))
        found.append(Case("yaml", "a list", option, f"{option}: [a, b]\n", option))
        found.append(Case("yaml", "misspelled", option, f"{typo}: 1\n", typo))
    return found


def startup_inputs(case: Case, good: dict[str, str]) -> tuple[list[str], str | None]:
    """What mitmdump is given for ``case``: its ``--set`` values (``name=value``, or a bare
    ``name``), in command-line order (the case's own, then each good option the case does not
    name), and its config.yaml text (None: no file)."""
    settings = dict(good)
    sets: list[str] = []
    yaml_text = None
    if case.source == "--set":
        args = case.spec.split("\0")
        assert set(args[::2]) == {"--set"}, args
        sets = args[1::2]
        for spec in sets:
            settings.pop(spec.split("=", 1)[0], None)
    else:
        yaml_text = case.spec
        settings.pop(case.spec.split(":", 1)[0], None)
    sets += [f"{name}={value}" for name, value in settings.items()]
    return sets, yaml_text
