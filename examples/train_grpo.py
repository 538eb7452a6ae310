"""GRPO on a CPU with TRL, from agenttap rollouts of a real agent, new weights pushed every step.

    scripts/setup.sh                                 # .venv, .venv-vllm, Claude Code, .venv-train
    .venv-train/bin/python examples/train_grpo.py    # Claude Code, 10 steps, a few minutes
    .venv-train/bin/python examples/train_grpo.py --agent-command "python3 my_agent.py"

What runs: the embedded policy (vLLM serving the tiny random Qwen3 of ``.cache/tiny-qwen3``,
started as ``scripts/run_proxy.sh`` starts it: ``python -m policy_server`` in ``.venv``;
or ``--policy-url``), agenttap (``AgentTap.start``), and TRL's ``GRPOTrainer`` on the same model
here, on the CPU. Each step TRL asks ``capture.train.trl``'s rollout function for
``--prompts-per-step`` tasks × ``--n`` agents: agenttap runs them (Claude Code by default, each
sandboxed in a copy of a task folder), each task's own verifier scores its answer, and the
agents' main rows come back as token ids, masks and logprobs, exactly what the policy sampled.
After the optimizer step the model is saved (``save_pretrained``) to ``OUT/weights/step-N`` and
pushed to the policy (``tap.update_weights(folder, "step-N", model=model, ...)``), with a probe
computed from the model in memory (``capture.train.probe``): each policy server's logprobs for
it are checked after the load (the step's line says ``checked, max |diff|``). The next
rollouts sample from the new weights, and their rows say so (``weight_versions``). Training
runs in fp32, as the policy serves the model (TRL's default on a CPU is bf16 autocast).

``--seed N`` repeats a run on the same machine: torch is seeded, and so is the policy's
sampling (``make_rollout_func(..., seed=N)``: each call gets a seed from N, the step, the task
and the agent, and its prompt). The agents' prompts name their working folder, which the
sandbox shows at ``/workdir`` whatever ``--out`` is, so any folder repeats the run. Another
seed, another run.

The reward: a random tiny model cannot do a task, but it can learn a style. Every task here
asks for an answer in capital letters and its verifier scores the share of the letters of the
policy's answer (the tokens it sampled, decoded) that are capitals (``shouting``). It can only
rise if gradients flow from the rows into new weights and those weights into the next rollouts.
Runs differ from seed to seed. Measured here (2 shared CPU cores; ``--seed 0 --keep-weights``
on the embedded policy, 10 steps of 8 rollouts, about 500 s a run), the reward mean by step,
the same in ``--out train-grpo`` and in ``--out some/deeper/folder/run-b``:

    --seed 0: 0.076 0.083 0.127 0.107 0.089 0.074 0.095 0.160 0.244 0.362

every push checked (max |diff| at most 7.6e-6), and ``check_logprobs`` of the step-10 rows
(sampled by ``step-9``) 3.8e-6 by ``step-9``'s weights. (Before the agents saw their folders
at fixed places, seeds 0, 1 and 2 ended at 0.317, 0.098 and 0.538, and another folder was
another run.) What the tiny random model learns, when it does, is the easy
way: repeating an all-capitals token; once every answer of a group scores the same, GRPO's
advantages, and so the grad norm, are 0.

Answers are capped at ``--max-tokens`` (Claude Code's ``CLAUDE_CODE_MAX_OUTPUT_TOKENS``) and
each agent gets one model call (``max_calls`` 1): a policy that forgets to stop would otherwise
write thousands of tokens per call on a CPU. Claude Code then exits non-zero (agenttap refused
the continuation it asked for), which agenttap counts as reaching a limit, not as a failure:
the rollout is scored.
A checkpoint is saved every ``--save-steps`` steps (``OUT/trainer``); ``--resume`` goes on
from the latest one, its weights pushed to the policy first, with the same following steps as
an uninterrupted run. The trainer's logs (``--report-to``, TensorBoard in ``OUT/tensorboard`` by
default) hold agenttap's rollout numbers (``agenttap/...``) beside TRL's loss and grad norm.
Two lines are printed per step: reward mean, loss, grad norm, tokens, the weight version the
rollouts were sampled by and the one pushed, rollout, train and push seconds and the push's
check; then each rollout's reward in full.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from capture.client.launcher import AgentTap  # noqa: E402
from capture.rollouts.agents import claude_code_capped  # noqa: E402
from capture.train.metrics import push_max_diff, push_metrics  # noqa: E402
from capture.train.rows import main_row, sampled_ids  # noqa: E402
from capture.train.trl import (  # noqa: E402
    AgentTapRolloutFunc,
    agenttap_reward,
    log_to_trainer,
    make_rollout_func,
)
from capture.train.trl_cpu import cpu_friendly  # noqa: E402

try:
    import torch
    from datasets import Dataset
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer
except ImportError as exc:  # the proxy's .venv has no torch, on purpose
    sys.exit(
        f"{exc}: run this with the trainer's environment, .venv-train/bin/python "
        "(scripts/setup_train.sh builds it)"
    )


def shouting(text: str) -> float:
    """The share of the text's letters that are capitals (0 for a text without letters)."""
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


class Answers:
    """The policy's answer in a rollout: the tokens it sampled in the agent's main row, decoded
    (what the agent printed may be an error line of the agent's own)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, run: dict[str, Any]) -> str:
        row = main_row(run.get("rows") or [])
        if row is None:
            return ""
        return str(self.tokenizer.decode(sampled_ids(row), skip_special_tokens=True))


# The tasks, each with its verifier (the task's text, one agent's rollout, how to read the
# policy's answer → reward). These all ask for capitals, so one policy can learn them together;
# a real task list checks its own thing in each (files in the agent's workdir, tests run...).
Verifier = Callable[[str, dict[str, Any], Answers], float | None]
TASKS: dict[str, Verifier] = {
    "Answer in CAPITAL LETTERS ONLY: what is the capital of France?": (
        lambda task, run, answer: shouting(answer(run))
    ),
    "SHOUT YOUR ANSWER IN CAPITALS: name three colours.": (
        lambda task, run, answer: shouting(answer(run))
    ),
}


def start_policy(
    model: Path, log: Path, start_timeout: float = 300.0
) -> tuple[subprocess.Popen[str], str]:
    """The embedded policy, as scripts/run_proxy.sh starts it: its URL once it serves."""
    proxy_python = REPO / ".venv" / "bin" / "python"
    if not proxy_python.exists():
        sys.exit(f"{proxy_python} not found: run scripts/setup.sh first")
    cmd = [
        str(proxy_python), "-m", "policy_server", "--model", str(model),
        "--start-timeout", str(start_timeout),
    ]  # fmt: skip
    proc = subprocess.Popen(
        [*cmd, "--log", str(log)], cwd=REPO, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line.rstrip(), flush=True)
        if line.startswith("POLICY_URL="):
            return proc, line.strip().partition("=")[2]
    proc.wait()
    sys.exit(f"the embedded policy did not start; its log: {log}")


def check_policy(url: str) -> None:
    """Exit, saying which flag to fix, unless a server answers vLLM's model list at ``url``."""
    from rewriter.policy_url import parse_policy_url, urlopen

    try:
        parse_policy_url(url)
        with urlopen(url, "/v1/models", timeout=10) as resp:
            resp.read()
    except (ValueError, OSError) as exc:
        sys.exit(
            f"--policy-url {url}: no vLLM answers there ({exc}); give the URL of a running vLLM "
            "serving --model, or leave --policy-url out to start the embedded policy"
        )


def pushed_words(answer: dict[str, Any]) -> str:
    """A weight push's check, as the step's line says it."""
    diff = push_max_diff(answer)
    if answer.get("checked") and diff is not None:
        return f"checked, max |diff| {diff:.1e}"
    return "not checked"


def checkpoint_step(folder: Path) -> int | None:
    """N of a ``checkpoint-N`` folder the trainer saved (None: another name)."""
    number = folder.name.removeprefix("checkpoint-")
    return int(number) if number != folder.name and number.isdigit() else None


def last_checkpoint(out: Path) -> Path | None:
    """The latest ``checkpoint-N`` the trainer saved under ``out/trainer`` (None: none)."""
    found = [p for p in (out / "trainer").glob("checkpoint-*") if checkpoint_step(p) is not None]
    return max(found, key=lambda p: checkpoint_step(p) or 0, default=None)


class StepReport(TrainerCallback):  # type: ignore[misc]
    """After each optimizer step: save the model, push it to the policy, print one line."""

    def __init__(
        self, tap: Any, rollouts: AgentTapRolloutFunc, weights: Path, keep: bool, bar: Any
    ) -> None:
        self.tap = tap
        self.rollouts = rollouts
        self.weights = weights
        self.keep = keep
        self.bar = bar
        self.step_started = 0.0
        self.pending: dict[str, Any] = {}
        self.curve: list[float] = []
        self.trainer: Any = None  # set once made: the push's check goes into its logs

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step_started = time.monotonic()

    def group_done(self, answer: dict[str, Any], ended: int, groups: int) -> None:
        """A line per rollout group as it ends (into a file; on a terminal the bar says it)."""
        runs = answer.get("rollouts") or []
        ok = sum(r.get("status") == "ok" for r in runs)
        line = (
            f"  group {ended}/{groups} {answer.get('id')}: {ok}/{len(runs)} ok, "
            f"{time.monotonic() - self.step_started:.1f} s into the step"
        )
        if self.bar.disable:
            print(line, flush=True)
        else:
            self.bar.set_postfix_str(f"group {ended}/{groups}")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step_s = time.monotonic() - self.step_started
        model = kwargs["model"]
        folder = self.weights / f"step-{state.global_step}"
        pushed = time.monotonic()
        model.save_pretrained(folder)
        # With the model in memory, every policy server is checked against its own logprobs
        # (capture.train.probe: the weights' forward, outside the trainer's autocast).
        answer = self.tap.update_weights(
            folder, f"step-{state.global_step}", model=model, tokenizer=kwargs["processing_class"]
        )
        push_s = time.monotonic() - pushed
        checked = pushed_words(answer)
        # Logged with this step's numbers (the trainer logs after on_step_end).
        log_to_trainer(self.trainer, push_metrics(answer, push_s))
        if not self.keep:  # the policy has loaded it; earlier steps' folders are not needed
            for old in self.weights.glob("step-*"):
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)
        last = self.rollouts.last
        rewards = [r for r in last.rewards if r is not None]
        self.pending = {
            "step": state.global_step,
            "reward": statistics.fmean(rewards) if rewards else math.nan,
            "scored": len(rewards),
            "agents": last.agents,
            "tokens": last.tokens,
            "trained": last.trained_tokens,
            "sampled_by": ",".join(last.versions) or "?",
            "pushed": f"step-{state.global_step}",
            "rollout_s": last.seconds,
            "train_s": step_s - last.seconds,
            "push_s": push_s,
            "checked": checked,
            "rewards": last.rewards,
        }

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if not self.pending or not logs or "loss" not in logs:
            return
        p, self.pending = self.pending, {}
        self.curve.append(p["reward"])
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{p['reward']:.3f}")
        self.bar.write(
            f"step {p['step']:>2}  reward {p['reward']:.3f} ({p['scored']}/{p['agents']} scored)"
            f"  loss {logs['loss']:+.4f}  grad_norm {logs.get('grad_norm', math.nan):.4f}"
            f"  tokens {p['tokens']} ({p['trained']} trained)  sampled by {p['sampled_by']}"
            f" -> pushed {p['pushed']}  rollout {p['rollout_s']:.1f} s  train {p['train_s']:.1f} s"
            f"  push {p['push_s']:.1f} s ({p['checked']})"
        )
        # Each rollout's reward, in full: two runs with one --seed print the same line.
        rewards = " ".join("-" if r is None else repr(r) for r in p["rewards"])
        self.bar.write(f"step {p['step']:>2}  rewards {rewards}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agent", default="claude-code", help="claude-code, codex or gemini")
    parser.add_argument(
        "--agent-command", default=None,
        help='any agent as a command line (the task is appended as its last argument), e.g. '
        '"python3 my_agent.py"; overrides --agent',
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--n", type=int, default=4, help="agents per task (GRPO's group)")
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--max-calls", type=int, default=1, help="model calls per agent")
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="Claude Code's answer cap, in tokens"
    )
    parser.add_argument(
        "--seed", type=int, default=0,
        help="seeds torch and the policy's sampling: the same seed, the same rewards (same "
        "machine, any --out)",
    )  # fmt: skip
    parser.add_argument("--out", default="train-grpo", help="shards, weights and logs go here")
    parser.add_argument(
        "--report-to", default="tensorboard",
        help="the trainer's loggers (TRL's report_to: tensorboard, wandb, none); TensorBoard "
        "writes to OUT/tensorboard, with agenttap's rollout numbers (agenttap/...) beside loss "
        "and grad norm",
    )  # fmt: skip
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the run an existing --out holds"
    )
    parser.add_argument(
        "--save-steps", type=int, default=5,
        help="a checkpoint (model, optimizer, RNG, trainer state) every this many steps, in "
        "OUT/trainer; the latest one only is kept",
    )  # fmt: skip
    parser.add_argument(
        "--resume", action="store_true",
        help="go on from --out's latest checkpoint (same arguments): the policy gets its "
        "weights, and the steps after it are those an uninterrupted run gives",
    )  # fmt: skip
    parser.add_argument("--policy-url", default=None, help="a policy already serving --model")
    parser.add_argument(
        "--start-timeout", type=float, default=300.0,
        help="seconds the embedded policy may take to start (a loaded machine needs more)",
    )  # fmt: skip
    parser.add_argument("--model", default=None, help="model folder (default: the tiny Qwen3)")
    parser.add_argument("--keep-weights", action="store_true", help="keep every step's folder")
    parser.add_argument(
        "--ray-actors", type=int, default=0,
        help="run the rollouts through a Ray pool of this many proxy actors (capture/client/"
        "ray_pool.py), each group's agents spread over them; 0: one agenttap here",
    )  # fmt: skip
    parser.add_argument(
        "--ray-address", default=None, help="with --ray-actors: your cluster (else a local one)"
    )
    args = parser.parse_args()
    if "tensorboard" in args.report_to and importlib.util.find_spec("tensorboard") is None:
        sys.exit(
            "--report-to tensorboard: tensorboard is not installed in this environment; "
            "run scripts/setup_train.sh (it installs it), or give --report-to none"
        )
    if args.policy_url is not None:
        check_policy(args.policy_url)  # before anything is written

    from policy_server.launcher import DEFAULT_MODEL_DIR, ensure_tiny_model

    out = Path(args.out).resolve()
    checkpoint = None
    if args.resume:
        checkpoint = last_checkpoint(out)  # before anything is started
        if checkpoint is None:
            sys.exit(
                f"--resume: {out / 'trainer'} holds no checkpoint to go on from (one is saved "
                "every --save-steps steps); run without --resume to start afresh"
            )
    elif out.exists() and any(out.iterdir()):
        if not args.overwrite:  # an earlier run is replaced only when asked, before anything
            sys.exit(
                f"{out} holds an earlier run (its shards, weights and logs): give --overwrite to "
                "replace it, --resume to go on from its last checkpoint, or another --out"
            )
        shutil.rmtree(out)  # a fresh run: its shards hold only this run's rows
    model_dir = Path(args.model) if args.model else ensure_tiny_model(DEFAULT_MODEL_DIR)
    (out / "task").mkdir(parents=True, exist_ok=True)
    (out / "task" / "README.md").write_text("Answer the question you are given.\n")
    weights = out / "weights"
    weights.mkdir(exist_ok=True)
    # A resumed run's rollouts are named apart from those the stopped run left for the same
    # steps (their rows stay in the shards, under their own ids, untrained).
    resumes = out / "resumes.jsonl"
    id_prefix = ""
    if checkpoint is not None:
        attempt = len(resumes.read_text().splitlines()) + 1 if resumes.exists() else 1
        id_prefix = f"resume{attempt}-"
        step = checkpoint_step(checkpoint)
        with resumes.open("a") as fh:
            fh.write(json.dumps({"from": checkpoint.name, "step": step, "ids": id_prefix}) + "\n")
        print(f"resuming from {checkpoint} (step {step}); its rollouts are {id_prefix}s...")
    if "tensorboard" in args.report_to:
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(out / "tensorboard")
        print(f"trainer logs: tensorboard --logdir {out / 'tensorboard'}", flush=True)
    torch.manual_seed(args.seed)
    agent: str | dict[str, list[str]] = args.agent
    if args.agent_command:
        agent = {"command": shlex.split(args.agent_command)}
    elif args.agent == "claude-code":
        agent = claude_code_capped(args.max_tokens)

    policy = None
    policy_url = args.policy_url
    if policy_url is None:
        policy, policy_url = start_policy(model_dir, out / "policy.log", args.start_timeout)
    try:
        with rollouts_on(args, policy_url, model_dir, out / "shards") as tap:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            answers = Answers(tokenizer)
            rollouts = make_rollout_func(
                tap, agent=agent, workdir=out / "task",
                verifier=lambda task, run: TASKS[task](task, run, answers),
                limits={"max_calls": args.max_calls}, metadata={"task_set": "shouting"},
                seed=args.seed, id_prefix=id_prefix,
            )  # fmt: skip
            tasks = list(TASKS)
            dataset = Dataset.from_dict(
                {"prompt": [tasks[i % len(tasks)] for i in range(args.steps * len(tasks) * 4)]}
            )
            config = GRPOConfig(
                output_dir=str(out / "trainer"),
                use_cpu=True,
                use_vllm=False,
                max_steps=args.steps,
                per_device_train_batch_size=args.n * args.prompts_per_step,
                num_generations=args.n,
                gradient_accumulation_steps=1,
                learning_rate=args.lr,
                lr_scheduler_type="constant",
                warmup_steps=0,
                beta=0.0,
                logging_steps=1,
                save_strategy="steps",
                save_steps=args.save_steps,
                save_total_limit=1,
                report_to=args.report_to,
                disable_tqdm=True,
                seed=args.seed,
                # fp32, as the policy serves the model: TRL's default on a CPU is bf16 autocast,
                # whose logprobs of the rows are ~0.1 from the sampler's.
                bf16=False,
                dataloader_num_workers=0,
            )
            # Resumed: the checkpoint's weights (the trainer loads them again, with its
            # optimizer and RNG), pushed to the policy before the next step samples from it.
            start = checkpoint if checkpoint is not None else model_dir
            model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
            if checkpoint is not None:
                answer = tap.update_weights(
                    checkpoint, f"step-{step}", model=model, tokenizer=tokenizer
                )
                print(f"pushed {checkpoint.name} as step-{step} ({pushed_words(answer)})")
            cpu_friendly(model)  # Claude Code's 12.8k-token rows on a CPU: see its docstring
            # The bar only on a terminal: into a file its redraws would share lines with the steps'.
            with tqdm(
                total=args.steps, desc="GRPO", unit="step", file=sys.stdout,
                disable=not sys.stdout.isatty(),
            ) as bar:  # fmt: skip
                report = StepReport(tap, rollouts, weights, args.keep_weights, bar)
                trainer = GRPOTrainer(
                    model=model, processing_class=tokenizer, reward_funcs=[agenttap_reward],
                    args=config, train_dataset=dataset, rollout_func=rollouts,
                    callbacks=[report],
                )  # fmt: skip
                trainer.remove_callback(PrinterCallback)  # our line per step instead
                report.trainer = trainer
                rollouts.on_group = report.group_done
                trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
            curve = " ".join(f"{r:.3f}" for r in report.curve)
            print(f"reward by step: {curve}")
            print(f"rows: {out / 'shards'}; last weights: {weights / f'step-{args.steps}'}")
    finally:
        if policy is not None:
            policy.terminate()
            policy.wait(60)


@contextmanager
def rollouts_on(
    args: argparse.Namespace, policy_url: str, model_dir: Path, shards: Path
) -> Iterator[Any]:
    """Where the rollouts run: one agenttap here, or (``--ray-actors N``) a Ray pool of N
    proxy actors, each group's agents spread over them (their shards under OUT/shards/proxy-K/,
    weights pushed through one actor and announced to the others)."""
    if not args.ray_actors:
        with AgentTap.start(policy_url, model_dir, shards) as tap:
            # The run's live view: its steps, groups and rows as they come (docs/VIEWER.md).
            print(f"live viewer: {tap.ui_url}", flush=True)
            yield tap
        return
    import ray

    from capture.client.ray_pool import ProxyPool

    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=False)
    try:
        with ProxyPool.start(
            policy_url, model_dir, shards, num_proxies=args.ray_actors, num_cpus=0.25
        ) as pool:
            yield pool
    finally:
        ray.shutdown()


def stop_on_term(*_: object) -> None:
    raise SystemExit(143)  # unwinds: the agents, agenttap and the policy are stopped


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental
    signal.signal(signal.SIGTERM, stop_on_term)
    hf_logging.disable_progress_bar()  # save_pretrained's bar each step; ours is the one
    main()
