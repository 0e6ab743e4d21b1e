"""RateLimitedLog (kvpool_server/log_limits.py): one line per kind per interval, whatever the rate of failures, the
held-back ones counted in the next line; kinds apart."""

from __future__ import annotations

import logging

from kvpool_server.log_limits import RateLimitedLog


def test_a_line_per_kind_per_interval_with_the_count_held_back(caplog):
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("kvpool_server.test"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        for i in range(100_000):
            now[0] = i * 0.0001  # 100,000 failures in 10 s
            log.warning_of("offload", "an offload of %d blocks failed", 8)
        log.warning_of("restore", "a restore failed")  # another kind: its own interval
        now[0] = 10.5
        log.warning_of("offload", "an offload of %d blocks failed", 8)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["an offload of 8 blocks failed", "a restore failed",
                     "an offload of 8 blocks failed (and 99,999 more like it in the last 10 s)"]
