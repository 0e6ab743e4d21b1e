#!/usr/bin/env python3
"""`make run`: a kvpool server, the 100-completion simulation from separate processes, a clean shutdown.

1. start `kvpool-server` on its default backend (auto: the GPU when there is one, host shared memory otherwise)
   on a unix socket in a fresh temporary directory, and wait until gRPC health says SERVING;
2. run `kvpool-loadgen` with its defaults (2 processes, 8 in flight, 100 uniform requests) (extra arguments to this script are passed on to it), which
   prints the dashboard and writes out/demo/summary.json and out/demo/memory.png (or under $KVPOOL_DEMO_OUT);
3. check the pool is empty again, SIGTERM the server and check it exits 0.

Exits non-zero if any step fails (including any KV verification error).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvpool_client import KVPoolClient
from kvpool_client.errors import KVPoolClientError

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = Path(os.environ.get("KVPOOL_DEMO_OUT", ROOT / "out" / "demo"))
STARTUP_TIMEOUT_S = 60.0
SHUTDOWN_TIMEOUT_S = 30.0


def command(script: str, module: str) -> list[str]:
    """The console script beside this interpreter, else ``python -m module``."""
    path = Path(sys.executable).with_name(script)
    return [str(path)] if path.exists() else [sys.executable, "-m", module]


def fail(message: str, log: Path | None = None) -> int:
    print(f"run_demo: FAIL: {message}", file=sys.stderr)
    if log is not None and log.exists():
        print("---- server log (last 40 lines) ----", file=sys.stderr)
        print("\n".join(log.read_text(errors="replace").splitlines()[-40:]), file=sys.stderr)
    return 1


def stop_server(server: subprocess.Popen) -> int | None:
    """SIGTERM and wait; None if it had to be killed."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            return None
    return server.returncode


def _show(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(loadgen_args: list[str]) -> int:
    if {"-h", "--help"} & set(loadgen_args):
        print(__doc__)
        print("usage: scripts/run_demo.py [kvpool-loadgen options]; the load generator's options follow.\n")
        return subprocess.call(command("kvpool-loadgen", "kvpool_client.loadgen.main") + ["--help"])
    workdir = Path(tempfile.mkdtemp(prefix="kvpool-demo-", dir="/tmp"))  # short: sun_path is 107 bytes at most
    socket_path, log_path = workdir / "kvpool.sock", workdir / "server.log"
    target = f"unix:{socket_path}"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    summary_path, plot_path = OUT_DIR / "summary.json", OUT_DIR / "memory.png"
    summary_path.unlink(missing_ok=True)

    server_cmd = command("kvpool-server", "kvpool_server") + ["--unix-socket", str(socket_path), "--address", ""]
    print(f"run_demo: starting {' '.join(server_cmd)}", flush=True)
    with open(log_path, "wb") as log:
        server = subprocess.Popen(server_cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with KVPoolClient(target, timeout=5.0) as client:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while True:
                if server.poll() is not None:
                    return fail(f"the server exited with {server.returncode} while starting", log_path)
                try:
                    client.wait_until_serving(timeout=1.0)
                    break
                except KVPoolClientError:
                    if time.monotonic() > deadline:
                        return fail(f"the server was not SERVING after {STARTUP_TIMEOUT_S:.0f}s", log_path)
            desc = client.describe_pool()
        print(
            f"run_demo: server pid {server.pid} SERVING on {target}: {desc.backend} pool of {desc.num_blocks:,} "
            f"blocks x {desc.layout.block_size} tokens ({desc.pool_bytes / (1 << 20):,.0f} MiB)",
            flush=True,
        )

        loadgen_cmd = command("kvpool-loadgen", "kvpool_client.loadgen.main") + [
            "--target", target, "--json", str(summary_path), "--plot", str(plot_path), *loadgen_args,
        ]
        print(f"run_demo: running {' '.join(loadgen_cmd[:1] + loadgen_cmd[3:])}", flush=True)
        loadgen_rc = subprocess.call(loadgen_cmd)
        if loadgen_rc != 0:
            return fail(f"kvpool-loadgen exited with {loadgen_rc}", log_path)
        summary = json.loads(summary_path.read_text())
        end = summary["end"]
        if end["blocks_used"] != 0 or end["sequences"] != 0:
            return fail(f"the pool is not empty after the run: {end}", log_path)
    finally:
        server_rc = stop_server(server)

    if server_rc != 0:
        return fail(f"the server did not exit 0 after SIGTERM (exit {server_rc})", log_path)
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"run_demo: summary {_show(summary_path)}, plot {_show(plot_path)}")
    print("run_demo: server stopped cleanly (SIGTERM, exit 0). OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
