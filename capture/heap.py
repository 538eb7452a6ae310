"""The proxy's garbage collector, set for a long-running server with a large, settled heap.

After start-up the process holds a few hundred thousand objects that live as long as it does
(mitmproxy, the tokenizer's vocabulary, the chat templates, pydantic's schemas). Python's cyclic
collector walks all of them on every full collection, and with its default thresholds it runs
a young collection every 700 allocations: together about 8% of the proxy's CPU at 48 streams,
and full collections of 150 ms that stall every stream at once (bench/paced.py). Frozen, the
start-up heap is never walked again; with a larger first threshold young collections run a
fourteenth as often. Garbage is still collected: reference counting frees almost everything
at once, and the collector still finds cycles made after start-up.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)

# Allocations (less deallocations) between two young collections; Python's default is 700.
YOUNG_THRESHOLD = 10_000


def settle_heap(young_threshold: int = YOUNG_THRESHOLD) -> int:
    """Collect what start-up left, move every surviving object out of the collector's sight
    (``gc.freeze``) and raise the young generation's threshold. Call once, when start-up is
    done. Returns how many objects were frozen."""
    if young_threshold < 1:
        raise ValueError(f"young_threshold must be 1 or more, not {young_threshold!r}")
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, old)
    frozen = gc.get_freeze_count()
    logger.debug("heap settled: %d objects frozen, young threshold %d", frozen, young_threshold)
    return frozen
