"""kvpool-loadgen: P client processes keep C requests in flight against a kvpool server until N complete.

    kvpool-loadgen --target unix:/tmp/kvpool.sock                       # the defaults: 2 processes, 8 in flight, 100 uniform
    kvpool-loadgen --lengths sharegpt --mode beam --beam-width 4 --json out/beam4.json --plot out/beam4.png

Exit status: 0 when every request completed and verified with 0 KV errors and the server's invariants hold;
1 otherwise; 2 for bad arguments or no server; 130 (143) when SIGINT / Ctrl-C (SIGTERM) stopped the run -- the
summary of what was done is printed and written all the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import grpc

from kvpool_client.client import KVPoolClient
from kvpool_client.credentials import ENV_TOKEN, ENV_TOKEN_FILE, CredentialsError
from kvpool_client.errors import InternalError, KVPoolClientError, PermissionDeniedError, UnauthenticatedError
from kvpool_client.loadgen import prefix_summary as prefix
from kvpool_client.loadgen import auth, preflight
from kvpool_client.loadgen import tenants as tenancy
from kvpool_client.loadgen.args import build_parser, check_args
from kvpool_client.loadgen.dashboard import render
from kvpool_client.loadgen.processes import collect, spawn
from kvpool_client.loadgen.summary import EndState, RunSetup, summarize
from kvpool_client.loadgen.workload import distribution, sequences_per_request


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Run the load and return the summary (see docs/loadgen.md for every field): set up, spawn the processes,
    collect their reports, check the server, summarize."""
    setup = prepare(a)
    workers = spawn(a, setup.tenants, setup.dist, setup.num_procs)
    collected = collect(a, workers, setup.tenants, setup.main_token)
    return summarize(a, setup, collected, end_state(a, setup.main_token))


def prepare(a: argparse.Namespace) -> RunSetup:
    """Read the tokens and TLS files (auth.py), connect, describe the pool and check that the load can fit and that
    every process may map the pool (preflight.py)."""
    run_creds = auth.resolve(a)
    run_creds = dataclasses.replace(run_creds, creds=run_creds.creds.for_target(a.target))  # unix: never TLS
    a.token, a.admin_token, a.tls = run_creds.creds.token, run_creds.admin_token, run_creds.creds.with_token(None)
    tenants, main_token = run_creds.tenants, run_creds.main_token
    if run_creds.admin_token or run_creds.creds.token or run_creds.tenants or run_creds.creds.tls:
        print(f"kvpool-loadgen: {run_creds.describe()}", file=sys.stderr)
    with KVPoolClient(a.target, timeout=a.timeout, **a.tls.with_token(main_token).client_kwargs()) as client:
        preflight.connect(client, a.target, a.connect_timeout, a.tls)
        desc = client.describe_pool()
        before = client.stats()
    num_procs = min(a.processes, a.concurrency)
    if a.kv_path == "attach":  # else a process that may not attach moves KV over gRPC (kv_path.py)
        for token in sorted(set(run_creds.worker_tokens(num_procs)), key=str):
            preflight.check_attach(a.target, a.tls.with_token(token), tenancy.tenant_of(tenants, token))
    dist = distribution(a.lengths, a.max_len)
    width = sequences_per_request(a.mode, a.beam_width, a.num_samples)
    seq_max_len = prefix.longest_sequence(a, dist)  # shared-prefix: the whole prompt + output; chat: the last turn
    fit = preflight.pool_fit(desc.num_blocks, desc.layout.block_size, seq_max_len, width, a.concurrency)
    if not fit.one_fits:
        raise preflight.NoRoomError(preflight.too_small_message(fit, seq_max_len))
    if not fit.all_fit:
        print(f"kvpool-loadgen: warning: {a.concurrency} requests in flight may need up to {fit.blocks_in_flight} "
              f"blocks and the pool has {desc.num_blocks}: expect RESOURCE_EXHAUSTED retries", file=sys.stderr)
    return RunSetup(tenants, main_token, desc, before, dist, width, seq_max_len, num_procs)


def end_state(a: argparse.Namespace, main_token: str | None) -> EndState:
    """The server's stats after the run, and its invariants (a frontend token may not check them: not checked)."""
    with KVPoolClient(a.target, timeout=a.timeout, **a.tls.with_token(main_token).client_kwargs()) as client:
        after = client.stats()
        try:
            client.check_invariants()
            return EndState(after, True, "", True)
        except InternalError as error:
            return EndState(after, False, str(error), True)
        except KVPoolClientError as error:
            if error.code is not grpc.StatusCode.PERMISSION_DENIED:
                raise
            return EndState(after, True, unchecked_reason(a), False)


def unchecked_reason(a: argparse.Namespace) -> str:
    """Why CheckInvariants was refused, and what to do: the admin token given is not an admin's, or none was."""
    if a.admin_token:
        where = a.admin_token_file or "KVPOOL_ADMIN_TOKEN"
        return (f"the token of {where} is not an admin's: CheckInvariants needs a token with role = \"admin\" in "
                "the server's tokens file")
    return "CheckInvariants needs an admin token: --admin-token-file FILE (env KVPOOL_ADMIN_TOKEN_FILE)"


def auth_hint(error: BaseException, a: argparse.Namespace) -> str:
    """What to do about a refused token, from what this run was given (kvctl says the same)."""
    if isinstance(error, PermissionDeniedError):
        return "; that call needs an admin token: --admin-token-file FILE (role = \"admin\" in the tokens file)"
    if not isinstance(error, UnauthenticatedError):
        return ""
    given = a.token_file or (ENV_TOKEN_FILE if os.environ.get(ENV_TOKEN_FILE) else None) or (
        ENV_TOKEN if os.environ.get(ENV_TOKEN) else None)
    if given is None:
        return (f"; the server asks for a token (--auth-tokens): give --token-file FILE (env {ENV_TOKEN_FILE}) or "
                f"set {ENV_TOKEN}")
    return (f"; the server does not know the token from {given} (mistyped, revoked, or another server's tokens "
            "file): check it against the server's --auth-tokens file (kvpool-token hash TOKEN gives its line)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(__doc__)
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        summary = run(args)
    except (KVPoolClientError, preflight.NoServerError, preflight.NoRoomError, tenancy.TokenFileError,
            CredentialsError) as error:
        print(f"kvpool-loadgen: {error}{auth_hint(error, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the workers ran, after them, or a second Ctrl-C: stop at once
        print("\nkvpool-loadgen: interrupted; no summary (a first Ctrl-C during the run stops it with one)",
              file=sys.stderr)
        return 128 + signal.SIGINT
    summary["diagnosis"] = preflight.explain_incomplete(summary)
    print(render(summary), flush=True)
    for line in summary["diagnosis"]:
        print(line, flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        try:
            from kvpool_client.loadgen.plot import plot_memory  # noqa: PLC0415

            plot_memory(summary, args.plot)
        except ImportError as error:  # matplotlib is the loadgen extra; the run itself does not need it
            print(f"kvpool-loadgen: no plot ({error}); pip install 'kvpool[loadgen]'", file=sys.stderr)
    if summary.get("interrupted"):
        return 128 + signal.Signals[summary["interrupted"]]
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
