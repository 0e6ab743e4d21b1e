"""The per-record table of a profiled fast-path thread (docs/results.md, "Where a record's time goes"): from the
``fastpath.prof`` that ``profile_server_threads.py`` writes, the records served and, per record, the cumulative
microseconds of the whole record and its parts (profiled: about twice the unprofiled times)::

    PROFILE_DIR=/tmp/prof .venv/bin/python benchmarks/bench_fastpath.py --procs 16 --seqs 64 --duration 3 --idle 0
    .venv/bin/python benchmarks/fastpath_profile_table.py /tmp/prof/fastpath.prof

"thread around it" is what the serving thread spends per record outside ``serve_record`` (its looks at the
channels, the fair share, the wake, the yield after each record); its parked time is not in it.
"""

from __future__ import annotations

import pstats
import sys

PARTS = (  # (label, function name, a part of its file's path)
    ("whole record (serve_record)", "serve_record", "fastpath/records.py"),
    ("service.append", "append", "service/kvpool.py"),
    ("of it the core (manager.append)", "append", "core/manager.py"),
    ("decode (request_arrays)", "request_arrays", "fastpath_codec.py"),
    ("reply (write_answer)", "write_answer", "fastpath/records.py"),
    ("call scope (enter + exit)", "__enter__", "service/scope.py"),
    ("", "__exit__", "service/scope.py"),
)


def cumulative(stats: pstats.Stats, name: str, path: str) -> tuple[int, float]:
    for (file, _, func), (_, calls, _, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        if func == name and path in file:
            return calls, cum
    return 0, 0.0


def main() -> None:
    stats = pstats.Stats(sys.argv[1])
    records, whole = cumulative(stats, "serve_record", "fastpath/records.py")
    _, loop = cumulative(stats, "_serve_ready", "fastpath/server.py")
    print(f"records {records}")
    if not records:
        return
    scope = 0.0
    for label, name, path in PARTS:
        _, seconds = cumulative(stats, name, path)
        if name in ("__enter__", "__exit__"):
            scope += seconds
            if name == "__exit__":
                print(f"  {'call scope (enter + exit)':34s} {1e6 * scope / records:7.1f} us")
            continue
        print(f"  {label:34s} {1e6 * seconds / records:7.1f} us")
    print(f"  {'thread around it (_serve_ready)':34s} {1e6 * (loop - whole) / records:7.1f} us")


if __name__ == "__main__":
    main()
