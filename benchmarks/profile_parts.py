"""Where a fast-path record's time goes, from a server thread's cProfile (``profile_server_threads.py``): the
cumulative time of named functions per call of the record loop's ``serve_record``, in microseconds.

    PROFILE_DIR=/tmp/prof16 .venv/bin/python benchmarks/bench_fastpath.py --procs 16 --seqs 64 --duration 3 --idle 0
    .venv/bin/python benchmarks/profile_parts.py /tmp/prof16/fastpath.prof [--parts serve_record,append,...]

A part names a function as ``file_suffix:function`` or ``function`` (every function of that name, summed). The
figures are under the profiler, so about twice the unprofiled ones: compare trees with the same tool.
"""

from __future__ import annotations

import argparse
import pstats

DEFAULT_PARTS = (
    "records.py:serve_record",          # the whole record
    "kvpool.py:append",                 # the service's AppendToken (KVPoolService.append)
    "manager.py:append",                # of it the core (KVCacheManager.append)
    "fastpath_codec.py:request_arrays",  # the record's decode
    "records.py:write_answer",          # the reply
)


def totals(stats: pstats.Stats, part: str) -> tuple[int, float]:
    """(calls, cumulative seconds) of every function ``part`` names."""
    suffix, _, name = part.rpartition(":")
    calls, seconds = 0, 0.0
    for (filename, _line, function), (_cc, nc, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if function == name and filename.endswith(suffix):
            calls += nc
            seconds += ct
    return calls, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", help="a .prof file of the fast-path thread")
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS), help="comma-separated file:function names")
    args = parser.parse_args()
    stats = pstats.Stats(args.profile)
    parts = args.parts.split(",")
    records, _ = totals(stats, parts[0])
    if not records:
        raise SystemExit(f"no calls of {parts[0]} in {args.profile}")
    print(f"{records} records; per record, us (profiled):")
    for part in parts:
        calls, seconds = totals(stats, part)
        print(f"  {part:<40} {seconds / records * 1e6:8.1f}   ({calls} calls)")


if __name__ == "__main__":
    main()
