"""``capture.reader``, as users import it: the same as ``capture.storage.reader``."""

from capture.storage.reader import (
    RLBatch,
    load_threads,
    row_kind,
    select_rows,
    to_batch,
    to_rl_batch,
    to_torch,
)

__all__ = [
    "RLBatch",
    "load_threads",
    "row_kind",
    "select_rows",
    "to_batch",
    "to_rl_batch",
    "to_torch",
]
