"""The rollout routes of the control API (capture/rollouts/runner.py runs them):

- ``POST /rollouts`` ``{"agent": "claude-code" | "codex" | "gemini" | "opencode" |
  "mini-swe-agent" | "openhands" | "terminus-2" | {"command": [...]}, "prompt", "workdir"?,
  "n"?, "limits"?,
  "metadata"?, "verifier"?: {"command": [...], "restore"?: ["tests/", ...]}, "sandbox"?:
  "bwrap" | "none", "id"?, "timeout_s"?, "wait"?}``:
  runs ``n`` agents (one group id: the rollout's id), each sandboxed unless ``"sandbox":
  "none"``, and answers, once all have ended, with each one's status, ``finish_reason``
  (``stop``, ``max_calls``, ``max_tokens``, ``deadline``, ``error``, ``cancelled``), reward,
  metrics and rows; ``"wait": false`` answers 202 at once (then ``GET /rollouts/{id}``). Past
  the cap on agents running at once: 429 with ``Retry-After``; a workdir with a symlink out of
  it, or bwrap missing: 400.
- ``GET /rollouts``, ``GET /rollouts/{id}`` (while it runs too), ``DELETE /rollouts/{id}``
  (its agents stop; their rows are kept, ``end_reason`` ``cancelled``).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from capture.isolation.workdir import check_seed
from capture.ports import RolloutHost
from capture.rollouts.admission import MemoryBusy
from capture.rollouts.runner import Busy, Rollouts
from capture.rollouts.spec import read_rollout

# What a refused rollout is told to wait before trying again.
RETRY_AFTER_S = 5


class RolloutRoutes:
    def __init__(self, api: RolloutHost, max_running: int) -> None:
        self.api = api
        self.rollouts = Rollouts(api, max_running)

    async def create(self, request: web.Request) -> web.Response:
        body = read_rollout(await self.api.body(request))
        spec = body.spec()
        # Every row's tokens make the answer megabytes for a few agents: a caller that reads
        # the rows from OUT (or GET /sessions/ID) asks for the summaries alone ("rows": false).
        wait, rows = body.wait, body.rows
        if spec.workdir is not None:  # a link out of it: refused before anything starts
            await asyncio.to_thread(check_seed, spec.workdir)
        try:
            rollout = self.rollouts.start(spec, wait)
        except (Busy, MemoryBusy) as exc:
            return web.json_response(
                {"error": {"message": str(exc), "status": 429}},
                status=429,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if not wait:
            return web.json_response(rollout.summary(rows=False), status=202)
        assert rollout.task is not None
        # A caller that hangs up does not stop the rollout (DELETE does).
        await asyncio.shield(rollout.task)
        return web.json_response(rollout.summary(rows=rows))

    async def list(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "running_agents": self.rollouts.running_agents(),
                "max_running": self.rollouts.max_running,
                "rollouts": [r.summary(rows=False) for r in self.rollouts.all()],
            }
        )

    async def get(self, request: web.Request, rollout_id: str) -> web.Response:
        rollout = self.rollouts.get(rollout_id)
        if rollout is None:
            return self._unknown(rollout_id)
        summary = rollout.summary(rows=request.query.get("rows", "1") not in ("0", "false"))
        # While it runs: each live session's counts so far.
        for run in summary["rollouts"]:
            live = self.api.session(run["session_id"])
            if live is not None and not live.closed:
                run["metrics"] = {**live.metrics.as_dict(), **run["metrics"]}
        return web.json_response(summary)

    async def delete(self, request: web.Request, rollout_id: str) -> web.Response:
        rollout = self.rollouts.get(rollout_id)
        if rollout is None:
            return self._unknown(rollout_id)
        await self.rollouts.cancel(rollout)
        return web.json_response(rollout.summary())

    @staticmethod
    def _unknown(rollout_id: str) -> web.Response:
        message = f"agenttap: no rollout {rollout_id!r}; GET /rollouts lists them"
        return web.json_response({"error": {"message": message, "status": 404}}, status=404)
