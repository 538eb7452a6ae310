"""Starts bwrap for a rollout as a user that owns nothing, when agenttap runs as root.

bwrap run by an unprivileged user can bind only paths that user can reach, and the paths a
sandbox must show often lie under folders only root may enter (a Python installed under
``/root/.pyenv``, OUT under a 0700 folder). So this launcher, run as root with the proxy's own
Python (``-I``: nothing of the environment or the cwd is imported), does what needs root in a
mount namespace of its own, then becomes the sandbox's user and execs bwrap:

1. it unshares its mount namespace (private: nothing it mounts is seen by the host), mounts a
   tmpfs at the staging folder and binds each path bwrap needs there, under a number: the
   staging folder can be entered by the sandbox's user, the paths' own folders need not be;
2. it drops root: no supplementary groups, the sandbox's gid and uid (real, effective, saved);
3. it execs the command, in which each ``@STAGED:N@`` is replaced by the staged path N.

The run's cgroups and rlimits are applied before it, by the prefix capture/isolation/cgroup.py
gives (``RolloutCgroup.launch_prefix``), which execs this launcher.

    python -I launch.py SPEC_JSON

The spec: ``{"stage": folder, "binds": [paths], "uid": n, "gid": n, "argv": [...]}``.
Standard library only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import sys

MS_NOSUID = 2
MS_NODEV = 4
MS_REC = 16384
MS_BIND = 4096
MS_PRIVATE = 1 << 18
# As capture/isolation/sandbox.py writes it (this file imports nothing of agenttap).
PLACEHOLDER = "@STAGED:{}@"


def _fail(what: str, err: int | None = None) -> None:
    reason = f": {os.strerror(err)}" if err else ""
    print(f"agenttap: the sandbox could not start: {what}{reason}", file=sys.stderr, flush=True)
    os._exit(126)


def main(spec: dict) -> None:
    argv: list[str] = list(spec["argv"])
    binds: list[str] = spec.get("binds", [])
    if binds:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)

        def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None):
            ok = libc.mount(
                src.encode() if src else None,
                dst.encode(),
                fstype.encode() if fstype else None,
                flags,
                data.encode() if data else None,
            )
            if ok != 0:
                _fail(f"mount {src} on {dst}", ctypes.get_errno())

        try:
            os.unshare(os.CLONE_NEWNS)
        except OSError as exc:
            _fail("a mount namespace of its own", exc.errno)
        mount(None, "/", None, MS_REC | MS_PRIVATE, None)
        stage = spec["stage"]
        mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0711,size=64k")
        for index, source in enumerate(binds):
            target = os.path.join(stage, str(index))
            if os.path.isdir(source):
                os.mkdir(target, 0o711)
            else:
                open(target, "w").close()
            mount(source, target, None, MS_BIND | MS_REC, None)
        staged = {PLACEHOLDER.format(i): os.path.join(stage, str(i)) for i in range(len(binds))}
        argv = [staged.get(arg, arg) for arg in argv]
    uid, gid = spec.get("uid"), spec.get("gid")
    if gid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
    if uid is not None:
        os.setresuid(uid, uid, uid)
    try:
        os.execv(argv[0], argv)
    except OSError as exc:
        _fail(f"running {argv[0]}", exc.errno)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
