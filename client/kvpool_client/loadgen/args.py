"""kvpool-loadgen's command line: the options (docs/loadgen.md) and their checks."""

from __future__ import annotations

import argparse
import os

from kvpool.cli_flags import CLIENT_TARGET_FLAGS, refuse_foreign_flags
from kvpool_client import diagnose
from kvpool_client.credentials import SecretSafeParser
from kvpool_client.loadgen import auth, preflight
from kvpool_client.loadgen.kv_path import KV_PATHS
from kvpool_client.loadgen.pattern import KEY_MULTIPLIER
from kvpool_client.loadgen.worker_config import EXHAUSTED_WAIT_S
from kvpool_client.loadgen.workload import MODES

WORKLOADS = ("standard", "shared-prefix", "chat")


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    p = SecretSafeParser(prog="kvpool-loadgen", description=description,
                         formatter_class=argparse.RawTextHelpFormatter,
                         allow_abbrev=False)  # no prefix of a flag stands for it (kvpool.cli_flags)
    refuse_foreign_flags(p, "kvpool-loadgen", CLIENT_TARGET_FLAGS)
    p.add_argument("--target", default=os.environ.get("KVPOOL_TARGET", "127.0.0.1:50051"),
                   help="server address: HOST:PORT or unix:PATH (env KVPOOL_TARGET; default %(default)s)")
    p.add_argument("--processes", "-p", type=int, default=2, help="client processes (default %(default)s)")
    p.add_argument("--concurrency", "-c", type=int, default=8, help="requests in flight, all processes (default 8)")
    p.add_argument("--completions", "-n", type=int, default=100, help="requests to complete (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload seed: same seed, same requests (default 0)")
    p.add_argument("--lengths", choices=("uniform", "sharegpt", "alpaca"), default="uniform",
                   help="uniform: prompt 4-32, target 32-256 (prompt + output); sharegpt / alpaca: lognormal")
    p.add_argument("--max-len", type=int, default=None,
                   help="longest sequence (prompt + output): 256 for uniform, 2048 for the lognormals")
    p.add_argument("--workload", choices=WORKLOADS, default="standard",
                   help="standard: --lengths prompts; shared-prefix: one of --num-prompts shared prompts + a unique "
                   "part, registered with its token ids (prefix caching), output lengths from --lengths;\n"
                   "chat: -n conversations of --turns turns, each turn's prompt the conversation so far")
    p.add_argument("--num-prompts", type=int, default=4, help="shared-prefix: shared prompts (default 4)")
    p.add_argument("--shared-tokens", type=int, default=8000,
                   help="shared-prefix: tokens of each shared prompt (default 8000)")
    p.add_argument("--unique-tokens", type=int, default=1000,
                   help="shared-prefix: tokens of each request's own prompt part (default 1000)")
    p.add_argument("--turns", type=int, default=4, help="chat: turns per conversation (default 4)")
    p.add_argument("--turn-tokens", type=int, default=64,
                   help="chat: tokens of each new user message (default 64); outputs from --lengths")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="shared-prefix / chat baseline: register without the prompt's ids and append without "
                   "token ids, so every request computes and holds its whole prompt")
    p.add_argument("--mode", choices=MODES, default="plain", help="plain, beam (search) or parallel (sampling)")
    p.add_argument("--beam-width", type=int, default=4, help="beams per request in --mode beam (default 4)")
    p.add_argument("--num-samples", type=int, default=4, help="samples per prompt in --mode parallel (default 4)")
    p.add_argument("--prune-every", type=int, default=4,
                   help="beam mode: every this many steps free the worst half of the beams, fork the best")
    p.add_argument("--verify", choices=("table", "readkv", "both"), default="both",
                   help="check KV before Free through GetBlockTable + the attached pool, ReadKV, or both")
    p.add_argument("--sample-interval-ms", type=float, default=5.0, help="Stats polling period (default 5 ms)")
    p.add_argument("--timeout", type=float, default=30.0, help="deadline of each RPC in seconds")
    p.add_argument("--connect-timeout", type=float, default=preflight.CONNECT_TIMEOUT_S,
                   help="seconds to wait for the server to answer SERVING at start (default %(default)s)")
    p.add_argument("--exhausted-wait", type=float, default=EXHAUSTED_WAIT_S, metavar="S",
                   help="seconds a step waits for other requests to free blocks when the pool is full, before the "
                   "worker gives up (default %(default)s)")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    p.add_argument("--json", metavar="PATH", help="write the summary (with downsampled series) as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of memory in use over time, paged vs naive")
    p.add_argument("--inject-errors", type=int, default=0, metavar="K",
                   help="self-test: corrupt one token of each of requests 0..K-1 before it is verified; the run "
                        "must then report the errors and exit 1")
    p.add_argument("--kv-source", choices=("auto", "host", "device"), default="auto",
                   help="write KV from host arrays, or from GPU arrays through the client's kernels (GPU pool "
                        "only); auto: device on a GPU pool, host otherwise (default auto)")
    p.add_argument("--kv-path", choices=KV_PATHS, default="auto",
                   help="how KV is written and verified: attach (the mapped pool: same host and IPC namespace, "
                   "and may_attach), grpc (WriteKV/ReadKV: from anywhere), auto: attach when the pool can be "
                   "mapped, else grpc, said in the dashboard (default auto)")
    p.add_argument("--no-fast-path", action="store_true",
                   help="every call over gRPC (default: register/append/fork/free over each process's shared-memory "
                   "channel when the server is on this host, docs/fast-path.md)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is off anyway when not a tty)")
    auth.add_options(p)  # --tenants, --token-file, --admin-token-file, --tls-* (auth.py)
    return p


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

        return version("kvpool")
    except PackageNotFoundError:
        return "unknown"


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    try:
        diagnose.check_target(a.target)
    except ValueError as error:
        p.error(str(error))
    if a.plot:
        try:
            import matplotlib  # noqa: F401, PLC0415  (the loadgen extra; checked now, not after the run)
        except ImportError:
            p.error("--plot needs matplotlib, which is not installed: pip install 'kvpool[loadgen]' "
                    "(or leave out --plot)")
    if a.kv_path == "grpc" and a.verify == "table":
        p.error("--verify table reads the mapped pool; with --kv-path grpc verification is by ReadKV (--verify readkv)")
    if a.kv_path == "grpc" and a.kv_source == "device":
        p.error("--kv-source device writes into the mapped GPU pool; with --kv-path grpc KV goes from host arrays")
    if a.inject_errors < 0:
        p.error("--inject-errors must be >= 0")
    for name in ("processes", "concurrency", "completions", "beam_width", "num_samples", "prune_every"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.max_len is not None and a.max_len < 33 and a.lengths == "uniform":
        p.error("--max-len must be >= 33 for uniform lengths (targets start at 32)")
    if a.max_len is not None and not 2 <= a.max_len < KEY_MULTIPLIER:
        p.error(f"--max-len must be in [2, {KEY_MULTIPLIER}) (token keys are seq_id * {KEY_MULTIPLIER} + position)")
    if a.sample_interval_ms <= 0 or a.timeout <= 0 or a.connect_timeout <= 0 or a.exhausted_wait < 0:
        p.error("--sample-interval-ms, --timeout and --connect-timeout must be > 0, --exhausted-wait >= 0")
    if a.no_prefix_cache and a.workload == "standard":
        p.error("--no-prefix-cache is the baseline of --workload shared-prefix or chat")
    if a.workload == "chat":
        if a.mode != "plain":
            p.error("--workload chat runs --mode plain")
        if min(a.turns, a.turn_tokens) < 1:
            p.error("--turns and --turn-tokens must be >= 1")
        if a.turns * (a.turn_tokens + (a.max_len or 2048)) >= KEY_MULTIPLIER:
            p.error(f"--turns x (--turn-tokens + --max-len) must be < {KEY_MULTIPLIER}")
    if a.workload == "shared-prefix":
        if a.mode == "parallel":
            p.error("--workload shared-prefix runs --mode plain or beam")
        if min(a.num_prompts, a.shared_tokens, a.unique_tokens) < 1:
            p.error("--num-prompts, --shared-tokens and --unique-tokens must be >= 1")
        if a.shared_tokens + a.unique_tokens + (a.max_len or 2048) >= KEY_MULTIPLIER:
            p.error(f"--shared-tokens + --unique-tokens + --max-len must be < {KEY_MULTIPLIER}")
    if a.tenants < 0:
        p.error("--tenants must be >= 0")
    if a.tenants and not a.token_file:
        p.error("--tenants needs --token-file (or KVPOOL_TOKEN_FILE): one 'TENANT TOKEN' per line")
    if a.tenants and min(a.processes, a.concurrency) < a.tenants:
        p.error(f"--tenants {a.tenants} needs at least {a.tenants} processes (-p) and requests in flight (-c)")
