"""kvpool-server with cProfile on its event-loop thread and its fast-path thread: ``loop.prof`` and
``fastpath.prof`` in $PROFILE_DIR once the server has shut down (SIGTERM); PROFILE_THREADS=fastpath|loop picks one
(Python 3.12 profiles one at a time: the fast-path thread by default there). The server's own flags follow.

    PROFILE_DIR=/tmp/prof .venv/bin/python benchmarks/profile_server_threads.py --backend host ...
    .venv/bin/python -c "import pstats; pstats.Stats('/tmp/prof/fastpath.prof').sort_stats('cumulative').print_stats(30)"

The benchmarks that start a kvpool server through ``bench_service_servers.Server`` (bench_fastpath.py,
bench_service.py) start it through this script when PROFILE_DIR is set:

    PROFILE_DIR=/tmp/prof .venv/bin/python benchmarks/bench_fastpath.py --procs 16 --idle 0
"""

from __future__ import annotations

import asyncio
import cProfile
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from kvpool_server.fastpath import server as fast_path_server
from kvpool_server.grpc_api import server as grpc_server
from kvpool_server.main import main

OUT = os.environ.get("PROFILE_DIR", ".")


def profiled(run: Callable[[], Any], name: str) -> Any:
    profile = cProfile.Profile()
    profile.enable()
    try:
        return run()
    finally:
        profile.disable()
        os.makedirs(OUT, exist_ok=True)
        profile.dump_stats(os.path.join(OUT, name))


def loop_thread_init(self: Any) -> None:  # LoopThread.__init__, its thread's target profiled
    self.loop = asyncio.new_event_loop()
    self.thread = threading.Thread(target=lambda: profiled(self.loop.run_forever, "loop.prof"), name="kvpool-loop",
                                   daemon=True)
    self.thread.start()


if __name__ == "__main__":
    # PROFILE_THREADS: which of the two (comma-separated). From Python 3.12 one cProfile at a time per process (a
    # second one's enable() raises), so there the default is the fast-path thread alone.
    default = "fastpath" if sys.version_info >= (3, 12) else "fastpath,loop"
    threads = set(os.environ.get("PROFILE_THREADS", default).split(","))
    if "fastpath" in threads:
        serve_channels = fast_path_server.FastPathServer._run
        fast_path_server.FastPathServer._run = lambda self: profiled(lambda: serve_channels(self), "fastpath.prof")  # type: ignore[method-assign]
    if "loop" in threads:
        grpc_server.LoopThread.__init__ = loop_thread_init  # type: ignore[method-assign]
    sys.exit(main())
