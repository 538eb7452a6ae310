"""The old import path of the Harbor environment, kept for ``harbor run --env
capture.rollouts.harbor_env:SandboxEnvironment`` command lines written before it moved to
capture/harbor/env.py."""

from capture.harbor.env import SandboxEnvironment

__all__ = ["SandboxEnvironment"]
