"""TRL: agenttap rollouts as ``GRPOTrainer``'s ``rollout_func``.

    from trl import GRPOConfig, GRPOTrainer
    from capture.client.launcher import AgentTap
    from capture.train.trl import agenttap_reward, make_rollout_func

    with AgentTap.start(policy_url, tokenizer, out="rollouts") as tap:
        trainer = GRPOTrainer(
            model=model, processing_class=tokenizer, train_dataset=prompts,  # a "prompt" column
            args=GRPOConfig(num_generations=4, ...),
            reward_funcs=[agenttap_reward],
            rollout_func=make_rollout_func(
                tap, agent="claude-code", workdir="task",
                verifier=["sh", "-c", "test -f done && echo 1 || echo 0"]),
        )
        trainer.train()

TRL calls the function with this process's prompts, each already repeated ``num_generations``
times. Identical prompts become one agenttap rollout of ``n`` agents (one ``POST /rollouts``
each, all running at once up to the proxy's ``agenttap_max_rollouts``; a 429 waits for a
running one to end); each agent works in its own copy of ``workdir``. Per prompt, in order, it
returns the agent's **main row** (``capture.train.rows.main_row``) cut where the first call's
prompt ends:

- ``prompt_ids``: the row's tokens before its first trained token (the first call's prompt);
- ``completion_ids``: everything after, the policy's sampled tokens and, in a multi-turn row,
  the tool / environment tokens between its calls;
- ``logprobs``: the sampler's logprob of each completion token (0.0 on tool tokens);
- ``env_mask``: 1 on the tokens the row trains, 0 on tool / environment tokens (TRL's tool
  mask: no loss there);
- ``agenttap_reward``: the verifier's reward, or None; ``agenttap_reward`` (this module's
  reward function) hands it to TRL, where None means *unscorable*: TRL leaves it out of its
  group's baseline and gives it advantage 0;
- ``agenttap_session_id``, ``agenttap_weight_versions`` (the versions that sampled the trained
  tokens), for reward functions and logs.

**On Ray.** ``tap`` may be a ``ProxyPool`` (``capture/client/ray_pool.py``): each rollout's
agents are spread over the pool's nodes (``ProxyPool.rollout``), the workdir shipped to them.

**Metrics.** Each step's rollout numbers (``capture.train.metrics.rollout_metrics``, the same
names verl's adapter logs: reward mean and std within a
group, agents scored and ok, calls, tokens, refusals and seconds per agent, the weight versions
that sampled the step and their lag behind the trainer's, ``version_lag``) go into the
trainer's own logs under ``agenttap/``, beside TRL's loss, KL and grad norm: ``report_to``
carries them to TensorBoard or W&B.

**Failures.** A rollout whose agent or verifier failed has reward None (the rollout's
``on_error`` "skip", the default): its row is still returned (the trainer's batch keeps its
shape) but, unscorable, it moves nothing. A rollout that made no row at all (the agent never
reached the policy) returns a one-token stand-in (``filler_id``) with ``env_mask`` 0 and
reward None. A failed ``POST /rollouts`` (the proxy refused it) raises ``AgentTapError``.

**Seeds.** With ``seed`` (``make_rollout_func(..., seed=N)``), a run repeats on the same
machine: each rollout is ``POST /rollouts`` with a ``seed`` from ``N``, the trainer's step and
the task's place in the step (agenttap gives each agent, and each of its calls, a seed of its
own from it: vLLM samples the same tokens for the same prompt), and an ``id`` named by the
same three, ``s{N}-step{STEP}-{K}``, so a run's rollouts read the same in every repeat. An
agent's prompt names its working folder, which the sandbox shows at ``/workdir`` wherever OUT
is (``agenttap_sandbox_paths``), so a repeat needs no particular folder. A seeded run needs a
fresh agenttap (its rollout ids must be new there).

**Verifiers.** ``verifier`` is a command (run by agenttap in the agent's copy of the workdir;
its last output line is the reward), the route's whole ``{"command", "restore", "on_error"}``,
or a Python function ``verifier(prompt, run) -> float | None`` called here with the rollout's
answer (``run``: its ``agent_output``, ``workdir``, ``rows``, ``status``...); its reward is also
recorded on the session (a late reward), so the shards agree with what was trained.
``agent`` and ``workdir`` may be functions of the prompt's text (an agent, a folder per task).

**Advantages.** TRL's own advantages of each step (its grouping, its ``scale_rewards``) are
sent to their sessions at the step's end (``POST /sessions/ID/advantage``), for the viewer
to show instead of its estimate; a failure to send one is logged and training goes on.

No torch and no TRL import at module level: the function only moves token ids and numbers (the
step's-end callback is transformers' ``TrainerCallback``, imported once a trainer calls).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from capture.client.launcher import AgentTapError
from capture.storage.row_rules import reward_value, row_versions
from capture.train.metrics import rollout_metrics
from capture.train.rows import (
    DEFAULT_FILLER_ID,
    SplitRow,
    filler,
    main_row,
    prompt_text,
    split_row,
)
from capture.train.trl_advantages import AdvantageSender, AdvantageSink

PathLike = str | os.PathLike[str]
# A trainer-side verifier: (the prompt's text, the rollout's answer for one agent) -> reward.
VerifierFunc = Callable[[str, dict[str, Any]], float | None]
Verifier = list[str] | dict[str, Any] | VerifierFunc
Workdir = PathLike | Callable[[str], PathLike | None]
# A container image, or a function of the task's text giving one.
Image = str | Callable[[str], str | None]


class Rollouts(AdvantageSink, Protocol):
    """What runs the rollouts: one agenttap (``AgentTap``) or a Ray pool of them
    (``capture.client.ray_pool.ProxyPool``, the agents spread over its nodes). It takes the
    trainer's advantages too (``AdvantageSink.advantage``)."""

    @property
    def rollout(self) -> Callable[..., dict[str, Any]]: ...

    def get_rollout(self, rollout_id: str) -> dict[str, Any]: ...

    def reward(self, session_id: str, reward: float | dict[str, float]) -> None: ...


AgentSpec = str | dict[str, list[str]]
Agent = AgentSpec | Callable[[str], AgentSpec]

# How often a rollout that is still running is asked about, and how long a 429 (too many agents
# at once) waits before the request is sent again when no rollout of ours is running to wait for.
POLL_S = 0.5
BUSY_RETRY_S = 2.0


@dataclass
class RolloutStats:
    """What the last call did: for a trainer's logs."""

    seconds: float = 0.0
    rollouts: int = 0
    agents: int = 0
    failed: int = 0
    no_row: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    rewards: list[float | None] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    # The agents' sessions, in the order of the prompts.
    sessions: list[str] = field(default_factory=list)


def sample_from_run(
    run: Mapping[str, Any], reward: float | None, filler_id: int = DEFAULT_FILLER_ID
) -> dict[str, Any]:
    """One TRL sample (the keys ``rollout_func`` returns, one value each) from one agent's
    rollout answer: its main row split after the first call's prompt, or the masked stand-in
    when it made no row."""
    row = main_row(run.get("rows") or [])
    split: SplitRow = split_row(row) if row is not None else filler(filler_id)
    return {
        "prompt_ids": split.prompt_ids,
        "completion_ids": split.completion_ids,
        "logprobs": split.completion_logprobs,
        "env_mask": split.completion_mask,
        "agenttap_reward": reward,
        "agenttap_session_id": run.get("session_id"),
        "agenttap_weight_versions": row_versions(row) if row is not None else [],
    }


def log_to_trainer(trainer: Any, metrics: Mapping[str, float]) -> bool:
    """Put ``metrics`` where TRL's ``GRPOTrainer`` keeps its own per-step numbers
    (``trainer._metrics[mode]``): its ``log`` averages them over the logging steps and hands
    them to every ``report_to`` logger and the console with loss and KL. False where the
    trainer keeps none (another trainer, or none given)."""
    store = getattr(trainer, "_metrics", None)
    model = getattr(trainer, "model", None)
    mode = "train" if getattr(model, "training", True) else "eval"
    if not isinstance(store, Mapping) or mode not in store:
        return False
    for name, value in metrics.items():
        store[mode][name].append(value)
    return True


def group_prompts(prompts: Sequence[Any]) -> dict[str, list[int]]:
    """Task text → the positions of the prompts that hold it, in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt_text(prompt), []).append(i)
    return groups


class AgentTapRolloutFunc:
    """``rollout_func(prompts, trainer) -> dict`` for ``trl.GRPOTrainer``; see the module's
    docstring. ``last`` holds the stats of the latest call."""

    def __init__(
        self,
        tap: Rollouts,
        *,
        agent: Agent,
        workdir: Workdir | None = None,
        verifier: Verifier | None = None,
        limits: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        filler_id: int | None = None,
        seed: int | None = None,
        image: Image | None = None,
        task_folder: Workdir | None = None,
        id_prefix: str = "",
    ) -> None:
        self.tap = tap
        # Before a seeded run's rollout ids: a resumed run's (its rows apart from the ones the
        # stopped run left for the same steps).
        self.id_prefix = id_prefix
        self.image = image
        self.task_folder = task_folder
        self.agent = agent
        self.workdir = workdir
        self.verifier = verifier
        self.limits = limits
        self.metadata = metadata or {}
        self.timeout_s = timeout_s
        self.filler_id = filler_id
        self.seed = seed
        self.calls = 0  # the rollout function's calls so far: the step where TRL gives none
        # Called as each group ends (its answer, groups ended so far, groups in the step): a
        # trainer's progress per group.
        self.on_group: Callable[[dict[str, Any], int, int], None] | None = None
        self.last = RolloutStats()
        # TRL's advantages of each batch, to its sessions (capture/train/trl_advantages.py).
        self.advantages = AdvantageSender(tap)

    def __call__(self, prompts: list[Any], trainer: Any = None) -> dict[str, list[Any]]:
        self.advantages.send(trainer)
        self.advantages.watch_steps(trainer)
        started = time.monotonic()
        groups = group_prompts(prompts)
        step = getattr(getattr(trainer, "state", None), "global_step", None)
        answers = self._run_groups(groups, step)
        self.calls += 1
        filler_id = self._filler_id(trainer)
        samples: list[dict[str, Any] | None] = [None] * len(prompts)
        stats = RolloutStats(rollouts=len(groups), agents=len(prompts))
        for (task, positions), answer in zip(groups.items(), answers, strict=True):
            runs = answer.get("rollouts") or []
            if len(runs) != len(positions):
                raise AgentTapError(
                    f"rollout {answer.get('id')!r} returned {len(runs)} agents for "
                    f"{len(positions)} prompts"
                )
            for position, run in zip(positions, runs, strict=True):
                reward = self._reward(task, run)
                sample = sample_from_run(run, reward, filler_id)
                samples[position] = sample
                stats.failed += run.get("status") != "ok"
                stats.no_row += main_row(run.get("rows") or []) is None
                stats.tokens += len(sample["prompt_ids"]) + len(sample["completion_ids"])
                stats.trained_tokens += sum(sample["env_mask"])
                stats.rewards.append(reward)
                for version in sample["agenttap_weight_versions"]:
                    if version not in stats.versions:
                        stats.versions.append(version)
        stats.sessions = [str(s["agenttap_session_id"]) for s in samples if s is not None]
        stats.seconds = time.monotonic() - started
        self.last = stats
        keys = (
            "prompt_ids", "completion_ids", "logprobs", "env_mask", "agenttap_reward",
            "agenttap_session_id", "agenttap_weight_versions",
        )  # fmt: skip
        done = [s for s in samples if s is not None]
        assert len(done) == len(prompts)
        # Per group (a task's agents): its runs, and the rewards its samples carry.
        group_runs = [answer.get("rollouts") or [] for answer in answers]
        group_rewards = [[done[p]["agenttap_reward"] for p in ps] for ps in groups.values()]
        log_to_trainer(trainer, rollout_metrics(group_runs, group_rewards, stats.seconds))
        self.advantages.batch(stats.sessions, step + 1 if step is not None else None)
        return {key: [s[key] for s in done] for key in keys}

    # -- running -----------------------------------------------------------------------------
    def _run_groups(self, groups: dict[str, list[int]], step: int | None) -> list[dict[str, Any]]:
        """Start one rollout per task (n = its prompts), all at once where the proxy's cap
        allows, and wait for every one; their answers, in the order of ``groups``."""
        pending = list(enumerate(groups.items()))
        at = step if step is not None else self.calls
        running: dict[int, str] = {}
        answers: dict[int, dict[str, Any]] = {}
        while pending or running:
            while pending:
                index, (task, positions) = pending[0]
                try:
                    agent = self.agent(task) if callable(self.agent) else self.agent
                    started = self.tap.rollout(
                        agent, task, n=len(positions), wait=False,
                        **self._options(task, step), **self._seeded(at, index),
                    )  # fmt: skip
                except AgentTapError as exc:
                    if exc.status != 429:
                        if self.seed is not None and "in use" in str(exc):
                            raise AgentTapError(
                                f"{exc}: a seeded run names its rollouts by seed, step and task "
                                "and those ids are in use; run it on a fresh agenttap, "
                                "or give another seed",
                                exc.status,
                            ) from exc
                        raise
                    if not running:  # the cap is held by others: try again shortly
                        time.sleep(BUSY_RETRY_S)
                    break
                running[index] = started["id"]
                pending.pop(0)
            time.sleep(POLL_S)
            for index, rollout_id in list(running.items()):
                answer = self.tap.get_rollout(rollout_id)
                if answer.get("status") == "done":
                    answers[index] = answer
                    del running[index]
                    if self.on_group is not None:
                        self.on_group(answer, len(answers), len(groups))
        return [answers[i] for i in range(len(groups))]

    def _options(self, task: str, step: int | None) -> dict[str, Any]:
        workdir = self.workdir(task) if callable(self.workdir) else self.workdir
        verifier = None if callable(self.verifier) else self.verifier
        metadata = {"split": "train", **self.metadata}
        if step is not None:
            # The step these rollouts train, as the trainer prints and logs it (its
            # ``global_step`` counts the steps done: 0 while the first one's rollouts run).
            # Rollout ids and seeds keep ``global_step``, so a seeded run repeats as before.
            metadata.setdefault("trainer_step", step + 1)
        image = self.image(task) if callable(self.image) else self.image
        folder = self.task_folder(task) if callable(self.task_folder) else self.task_folder
        options = {
            "workdir": workdir,
            "verifier": verifier,
            "limits": self.limits,
            "metadata": metadata,
            "timeout_s": self.timeout_s,
        }
        # A task's own container image, or a Harbor task folder (docs/API.md), only when given:
        # an older proxy knows neither.
        if image is not None:
            options["image"] = image
        if folder is not None:
            options["task"] = folder
        return options

    def _seeded(self, step: int, index: int) -> dict[str, Any]:
        """A seeded run's rollout ``seed`` and ``id`` for task ``index`` of ``step``; {} when
        the run is not seeded."""
        if self.seed is None:
            return {}
        return {
            "seed": rollout_seed(self.seed, step, index),
            "id": f"{self.id_prefix}s{self.seed}-step{step}-{index}",
        }

    def _reward(self, task: str, run: dict[str, Any]) -> float | None:
        if not callable(self.verifier):
            return reward_value(run.get("reward"))
        if run.get("status") != "ok":
            return None  # a failed agent is not scored, as agenttap's own verifiers do
        reward = reward_value(self.verifier(task, run))
        if reward is not None and run.get("rows"):
            # The shards hold the reward that was trained (a late reward on the session).
            self.tap.reward(run["session_id"], reward)
        return reward

    def _filler_id(self, trainer: Any) -> int:
        if self.filler_id is not None:
            return self.filler_id
        tokenizer = getattr(trainer, "processing_class", None)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor holds one
        for name in ("eos_token_id", "pad_token_id"):
            value = getattr(tokenizer, name, None)
            if isinstance(value, int):
                return value
        return DEFAULT_FILLER_ID


def rollout_seed(seed: int, step: int, index: int) -> int:
    """The ``POST /rollouts`` seed of task ``index`` of ``step`` in a run seeded ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{step}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def make_rollout_func(
    tap: Rollouts,
    *,
    agent: Agent,
    workdir: Workdir | None = None,
    verifier: Verifier | None = None,
    limits: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    timeout_s: float | None = None,
    seed: int | None = None,
    image: Image | None = None,
    task_folder: Workdir | None = None,
    id_prefix: str = "",
) -> AgentTapRolloutFunc:
    """``rollout_func`` for ``trl.GRPOTrainer(rollout_func=...)``: agenttap rollouts of
    ``agent`` (``claude-code``, ``codex``, ``gemini``, ``opencode``, ``mini-swe-agent`` or
    ``{"command": [...]}``, the task text appended as its last argument; or a function of the
    task's text giving one) on the
    trainer's prompts; see the module's docstring for what
    it returns and how failures and missing rewards are handed on. ``limits``: each agent's
    session limits (``max_calls``, ``max_tokens``, ``deadline_s``); ``metadata``: added to
    every session's (``split`` "train" and ``trainer_step``, the step they train as the
    trainer numbers it, from 1, are set unless given); ``seed``: the policy's sampling
    seeded, so a run repeats (see **Seeds**);
    ``image``: each agent runs in a container of that image (or a function of the task's text
    giving one); ``task_folder``: a Harbor task folder (or a function giving one), its image,
    tests and limits (docs/API.md); ``id_prefix``: before a seeded run's rollout ids (a resumed
    run's, apart from those the stopped run used for the same steps)."""
    if workdir is not None and not callable(workdir) and not Path(workdir).is_dir():
        raise ValueError(f"workdir {str(workdir)!r} is not a folder: give the task's folder")
    return AgentTapRolloutFunc(
        tap, agent=agent, workdir=workdir, verifier=verifier, limits=limits,
        metadata=metadata, timeout_s=timeout_s, seed=seed, image=image,
        task_folder=task_folder, id_prefix=id_prefix,
    )  # fmt: skip


def agenttap_reward(
    completions: list[Any], agenttap_reward: list[float | None], **_: Any
) -> list[float | None]:
    """The reward function to pass TRL with this rollout function (``reward_funcs=
    [agenttap_reward]``): the verifier's reward of each rollout; None (unscorable: advantage 0)
    where it has none."""
    return list(agenttap_reward)
