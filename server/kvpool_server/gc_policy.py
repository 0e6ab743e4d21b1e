"""The server's policy for Python's cyclic garbage collector, in one place (docs/architecture.md, "The garbage
collector"): applied once, after start-up, by ``main.serve``.

What a full collection costs is the objects it walks: every object the collector tracks in its old generation. The
per-block state (the prefix cache's and the host tier's records, the KV event log's batches) is kept in objects the
collector does not track or does not walk (``core/block_records.py``, ``core/event_records.py``), and ``apply``
freezes the start-up heap -- modules, the pool, the core's arrays and the lists holding those records -- so that
full collections while serving walk only what calls made since. Periodic freezing once the cache is warm was
not taken: a frozen object is never collected, so any cyclic structure alive at the freeze (a stream's,
a session's) would leak when it ends; the records need no freeze, having nothing to walk.

The thresholds stay Python's (700, 10, 10): with nothing per block in the old generation, full collections are
rare and short (benchmarks/bench_gc_pause.py, figures in docs/results.md).
"""

from __future__ import annotations

import gc


def apply() -> int:
    """Collect once, then move every object alive after start-up into the collector's permanent generation
    (``gc.freeze``: never walked, never collected -- what is alive at start-up lives as long as the server, and the
    records' lists among it are walked by no collection however full they get). vLLM does the same after its
    start-up. Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
