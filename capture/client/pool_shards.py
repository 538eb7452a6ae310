"""A proxy pool's shards (``capture/client/ray_pool.py``): where they are, copied to a
``pyarrow.fs`` filesystem, and read back as one ``pyarrow.dataset``.

Actor ``n`` writes to ``OUT_ROOT/proxy-<n>/``; with ``upload_to`` its ``Uploader`` copies its new
shard files to ``DEST/proxy-<n>/`` (to a hidden temporary name, then moved into place, so readers
never see a partial file); ``shard_files`` / ``open_dataset`` find every ``proxy-*/KIND`` shard
under a root, local or not.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs

# The shard folders of one instance (docs/SHARDS.md) that an upload copies.
SHARD_KINDS = ("turns", "threads", "failed", "rewards")
# The column ``dataset()`` adds: the folder of the proxy that wrote the row (``proxy-<n>``).
PROXY_COLUMN = "proxy"
# The sessions of rollout attempts whose node was lost (capture/client/pool_rollouts.py), at the
# pool's root: their rows, should any reach storage, are never read back.
LOST_FILE = "lost-sessions.json"


def resolve_filesystem(
    target: str, filesystem: pafs.FileSystem | None = None
) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for ``target``: a path inside ``filesystem`` when one is
    given, else a ``pyarrow.fs`` URI (``s3://``, ``gs://``, ``file://``, ...) or a local path."""
    if filesystem is not None:
        return filesystem, target.rstrip("/")
    if "://" in target:
        fs, path = pafs.FileSystem.from_uri(target)
        return fs, path.rstrip("/")
    return pafs.LocalFileSystem(), str(Path(target).resolve())


def shard_files(fs: pafs.FileSystem, base: str, kind: str = "threads") -> list[str]:
    """The finished Parquet shards of ``kind`` under every ``base/proxy-*/`` folder (hidden
    temporary files skipped), sorted."""
    proxies = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    found: list[str] = []
    for proxy in proxies:
        if proxy.type != pafs.FileType.Directory or not proxy.base_name.startswith("proxy-"):
            continue
        selector = pafs.FileSelector(f"{proxy.path}/{kind}", allow_not_found=True)
        found += [
            info.path
            for info in fs.get_file_info(selector)
            if info.type == pafs.FileType.File
            and info.base_name.endswith(".parquet")
            and not info.base_name.startswith((".", "_"))
        ]
    return sorted(found)


class Uploader:
    """Copies an instance's new or changed shard files to a ``pyarrow.fs`` filesystem."""

    def __init__(self, local_out: Path, fs: pafs.FileSystem, dest: str) -> None:
        self.local_out = local_out
        self.fs = fs
        self.dest = dest.rstrip("/")
        self._sent: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns)
        self._lock = threading.Lock()
        self.uploaded = 0

    def sync(self) -> list[str]:
        """Upload what is new since the last sync; returns the destination paths written."""
        local = pafs.LocalFileSystem()
        written = []
        with self._lock:
            for kind in SHARD_KINDS:
                folder = self.local_out / kind
                if not folder.is_dir():
                    continue
                for path in sorted(folder.glob("*.parquet")):
                    if path.name.startswith("."):
                        continue  # a shard being written (capture/storage/shards.py)
                    st = path.stat()
                    rel = f"{kind}/{path.name}"
                    if self._sent.get(rel) == (st.st_size, st.st_mtime_ns):
                        continue
                    final = f"{self.dest}/{rel}"
                    tmp = f"{self.dest}/{kind}/.{path.name}.tmp"
                    self.fs.create_dir(f"{self.dest}/{kind}", recursive=True)
                    pafs.copy_files(
                        str(path), tmp, source_filesystem=local, destination_filesystem=self.fs
                    )
                    self.fs.move(tmp, final)
                    self._sent[rel] = (st.st_size, st.st_mtime_ns)
                    written.append(final)
            self.uploaded += len(written)
        return written


def open_dataset(fs: pafs.FileSystem | str, base: str = "", kind: str = "threads") -> ds.Dataset:
    """Every ``base/proxy-*/kind`` shard under a pool's root as one ``pyarrow.dataset``, with a
    ``proxy`` column; ``fs`` a filesystem, or a URI / local path (``base`` then ignored)."""
    if isinstance(fs, str):
        fs, base = resolve_filesystem(fs)
    files = shard_files(fs, base, kind)
    if not files:
        raise FileNotFoundError(f"no {kind} shards under {base}/proxy-*/{kind}")
    # The first folder under ``base`` (proxy-<n>) becomes the ``proxy`` column.
    partitioning = ds.DirectoryPartitioning(pa.schema([(PROXY_COLUMN, pa.string())]))
    found = ds.dataset(
        files, filesystem=fs, format="parquet", partitioning=partitioning, partition_base_dir=base
    )
    lost = lost_session_ids(load_lost(fs, base))
    if lost and "session_id" in found.schema.names:
        # A lost attempt's rows (recovered from its journal later) are never trained.
        return found.filter(~ds.field("session_id").isin(sorted(lost)))  # type: ignore[no-any-return]
    return found


def load_lost(fs: pafs.FileSystem, base: str) -> list[dict[str, Any]]:
    """The lost attempts recorded under a pool's root (``LOST_FILE``); [] when there is none.
    A file that cannot be read as that list is an error (ValueError): reading on without it
    would train the lost attempts' rows."""
    path = f"{base}/{LOST_FILE}"
    try:
        with fs.open_input_stream(path) as fh:
            text = fh.read().decode()
    except FileNotFoundError:
        return []
    try:
        entries = json.loads(text)
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ValueError("not a list of objects")
    except ValueError as exc:
        raise ValueError(
            f"{path} (the sessions of rollout attempts lost with their node) cannot be read "
            f"({exc}); restore it or delete it knowingly: its sessions' rows would be read back"
        ) from None
    return entries


def save_lost(fs: pafs.FileSystem, base: str, entries: list[dict[str, Any]]) -> None:
    """Write ``entries`` as the pool's ``LOST_FILE`` (a temporary name, then moved in place)."""
    tmp = f"{base}/.{LOST_FILE}.{time.monotonic_ns()}"
    with fs.open_output_stream(tmp) as fh:
        fh.write(json.dumps(entries, indent=1).encode())
    fs.move(tmp, f"{base}/{LOST_FILE}")


def lost_session_ids(entries: list[dict[str, Any]]) -> set[str]:
    return {str(sid) for e in entries for sid in e.get("session_ids") or []}
