"""kvctl: look at (and, where the server allows, steer) a running kvpool-server.

    kvctl stats                       pool occupancy: blocks (used + free + evictable = total), usage, tokens,
                                      fragmentation, sharing, copies; prefix hits by tier; the host tier's blocks,
                                      copies, bandwidth and losses (kvctl_tier.py)
    kvctl sessions                    live sessions (ListSessions)
    kvctl sequences [--session S]     live sequences, of one session or all (ListSequences)
    kvctl block-table SEQ             one sequence's page table
    kvctl health                      gRPC health (exit 0 only when SERVING)
    kvctl drain [--wait S]            Drain RPC: NOT_SERVING, no new sessions; --wait until none is live (else 5)
    kvctl drain --resume              undo a drain: SERVING again, new sessions taken
    kvctl events [--batches N]        follow SubscribeEvents (the prefix cache's KV events); --json: a batch a line
    kvctl events --zmq ENDPOINT       the same events on vLLM's ZMQ wire (--kv-events-publish), as a router sees them
    kvctl top                         a live view: usage, rates and Stats latency, refreshed in place

Every command takes --json (one JSON document; `top --json` writes one line a refresh). Exit codes: 0 done,
1 the server answered with an error (or is not SERVING), 2 usage, 3 not available on this server, 4 no server,
5 `drain --wait` ran out with sessions or sequences still live (kvctl_drain.py).

A secured server (--auth-tokens, TLS): the token from --token-file FILE or KVPOOL_TOKEN (never an argument),
--tls-ca PEM, and --tls-cert PEM --tls-key PEM for mutual TLS (credentials.py; docs/ops.md).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import grpc
from rich import box
from rich.console import Console
from rich.table import Table

from kvpool.cli_flags import CLIENT_TARGET_FLAGS, refuse_foreign_flags
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from kvpool_client import credentials, diagnose, kvctl_drain
from kvpool_client.client import KVPoolClient
from kvpool_client.credentials import Credentials, CredentialsError
from kvpool_client.errors import KVPoolClientError, PermissionDeniedError, UnauthenticatedError, from_rpc_error
from kvpool_client.kvctl_tier import prefix_and_tier_rows
from kvpool_client.pages import all_pages

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_AVAILABLE, EXIT_NO_SERVER = 0, 1, 2, 3, 4
EXIT_NOT_DRAINED = kvctl_drain.EXIT_NOT_DRAINED  # 5
CONNECT_TIMEOUT_S = 3.0


class NotAvailable(Exception):
    """The server (or kvpool) does not offer this; the message says what to do instead."""


class Ctl:
    """One connection: the client library for what it wraps, the generated stub for what it does not yet."""

    def __init__(self, target: str, timeout: float, creds: Credentials | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self.creds = creds or Credentials()
        self.metadata = self.creds.metadata()
        self.channel = self.creds.channel(target)
        self.client = KVPoolClient(target, timeout=timeout, channel=self.channel, token=self.creds.token)
        self.stub = pb_grpc.KVPoolServiceStub(self.channel)

    def connect(self) -> None:
        """Fail fast, and say what happened, when no server answers at the target (diagnose.py): one Health call,
        which fails at once on a refused connection or a TLS mismatch and waits at most CONNECT_TIMEOUT_S."""
        problem = diagnose.probe(self.channel, self.target, min(CONNECT_TIMEOUT_S, self.timeout), self.creds.tls,
                                 self.creds.tls_server_name)
        if problem is not None:
            raise ConnectionError(problem.message)

    def call(self, name: str, request: Any) -> Any:
        """A KVPoolService RPC through the generated stub; UNIMPLEMENTED becomes NotAvailable."""
        try:
            return getattr(self.stub, name)(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise NotAvailable(
                    f"this kvpool-server does not implement {name} yet (UNIMPLEMENTED): it predates sessions; "
                    "upgrade the server to list them"
                ) from None
            raise from_rpc_error(error, name) from None

    def close(self) -> None:
        self.client.close()


# ---------------------------------------------------------------------------------------------- commands
def cmd_stats(ctl: Ctl, args: argparse.Namespace) -> tuple[dict, str]:
    stats = ctl.client.stats()
    pool = ctl.client.describe_pool()
    bytes_used = stats.num_blocks_used * stats.block_bytes
    data = {**asdict(stats), "bytes_used": bytes_used, "backend": pool.backend, "pool_bytes": pool.group_bytes,
            "server_pid": pool.server_pid, "tensor_parallel": pool.tensor_parallel}
    split = f", {pool.tensor_parallel} tensor-parallel shards" if pool.tensor_parallel > 1 else ""
    rows = [
        ("backend", f"{pool.backend} (server pid {pool.server_pid}){split}"),
        ("blocks", f"{stats.num_blocks_used:,} used + {stats.num_blocks_free:,} free + {stats.num_blocks_evictable:,} "
                   f"evictable = {stats.num_blocks_total:,}"),
        ("evictable", f"{stats.num_blocks_evictable:,} (prefix cache, no sequence holds them: allocatable, oldest "
                      "first)"),
        ("usage", f"{100 * stats.utilization:.2f}%  ({_mib(bytes_used)} of {_mib(pool.group_bytes)})"),
        ("block", f"{stats.block_size} tokens, {stats.block_bytes:,} bytes"),
        ("sequences", f"{stats.num_sequences:,}"),
        ("tokens", f"{stats.num_tokens:,}"),
        ("internal fragmentation", f"{100 * stats.internal_fragmentation:.2f}%  ({stats.num_slots_unused:,} slots)"),
        ("shared blocks", f"{stats.num_blocks_shared:,}"),
        ("copy-on-write copies", f"{stats.num_copies:,}"),
        *prefix_and_tier_rows(stats),
    ]
    return data, _table(rows)


def cmd_sessions(ctl: Ctl, args: argparse.Namespace) -> tuple[dict, str]:
    rows, reply = all_pages(ctl.call, "ListSessions", pb.ListSessionsRequest(), "sessions")
    sessions = [
        {"session_id": s.session_id, "client_name": s.client_name, "opened_unix_ms": s.opened_unix_ms,
         "lease_ttl_ms": s.lease_ttl_ms, "lease_remaining_ms": s.lease_remaining_ms,
         "keep_alive_open": s.keep_alive_open, "num_sequences": s.num_sequences, "num_blocks": s.num_blocks}
        for s in rows
    ]
    header = ("session", "client", "opened", "lease left", "keep-alive", "sequences", "blocks")
    lines = [(hex(s["session_id"]), s["client_name"] or "-",
              time.strftime("%H:%M:%S", time.localtime(s["opened_unix_ms"] / 1000)),
              f"{s['lease_remaining_ms'] / 1000:.1f}/{s['lease_ttl_ms'] / 1000:.1f} s",
              "open" if s["keep_alive_open"] else "-", s["num_sequences"], s["num_blocks"]) for s in sessions]
    text = _columns(header, lines) + f"\n{len(sessions)} sessions (server epoch {reply.server_epoch:#x})"
    return {"server_epoch": reply.server_epoch, "sessions": sessions}, text


def cmd_sequences(ctl: Ctl, args: argparse.Namespace) -> tuple[dict, str]:
    rows, _ = all_pages(ctl.call, "ListSequences", pb.ListSequencesRequest(session_id=args.session), "sequences")
    seqs = [{"seq_id": s.seq_id, "session_id": s.session_id, "num_tokens": s.num_tokens, "num_blocks": s.num_blocks}
            for s in rows]
    lines = [(s["seq_id"], hex(s["session_id"]) if s["session_id"] else "-", s["num_tokens"], s["num_blocks"])
             for s in seqs]
    text = _columns(("seq_id", "session", "tokens", "blocks"), lines) + f"\n{len(seqs)} sequences"
    return {"session_id": args.session, "sequences": seqs}, text


def cmd_block_table(ctl: Ctl, args: argparse.Namespace) -> tuple[dict, str]:
    table = ctl.client.block_table(args.seq_id)
    block_ids = [int(b) for b in table.block_ids]
    data = {"seq_id": args.seq_id, "num_tokens": table.num_tokens, "block_size": table.block_size,
            "block_ids": block_ids}
    text = (f"sequence {args.seq_id}: {table.num_tokens} tokens in {len(block_ids)} blocks of {table.block_size}\n"
            + "\n".join(f"  [{i * table.block_size:>6}, {min((i + 1) * table.block_size, table.num_tokens):>6}) "
                        f"-> block {b}" for i, b in enumerate(block_ids)))
    return data, text


def cmd_health(ctl: Ctl, args: argparse.Namespace) -> tuple[dict, str]:
    status = ctl.client.health(args.service)
    data = {"service": args.service, "status": status}
    if status != "SERVING":
        args.exit_code = EXIT_ERROR
    why = (" (draining -- `kvctl drain --resume` undoes a drain -- or shutting down)"
           if status == "NOT_SERVING" else "")
    return data, f"{args.service or 'server'}: {status}{why}"


def cmd_drain(ctl: Ctl, args: argparse.Namespace) -> tuple[dict, str]:
    """Drain RPC: NOT_SERVING, no new sessions; ``--wait`` until nothing is live, else exit 5 naming what is."""
    return kvctl_drain.cmd_drain(ctl.call, args)


def cmd_events(ctl: Ctl, args: argparse.Namespace) -> tuple[dict, str]:
    """Follow SubscribeEvents: one line per event (``--json``: one JSON object per batch), as they come; stops after
    ``--batches`` batches or ``--seconds`` (0: until Ctrl-C). Returns a summary."""
    request = pb.SubscribeEventsRequest()
    if args.from_seq is not None:
        request.from_seq = args.from_seq
    stream = ctl.stub.SubscribeEvents(request, timeout=args.seconds or None, metadata=ctl.metadata)
    batches = events = 0
    last: tuple[int, int] = (0, 0)
    try:
        for batch in stream:
            batches += 1
            events += len(batch.events)
            last = (batch.epoch, batch.seq)
            rows = [_event_row(e) for e in batch.events]
            if args.json:
                print(json.dumps({"epoch": batch.epoch, "seq": batch.seq, "snapshot": batch.snapshot,
                                  "num_dropped": batch.num_dropped, "events": rows}), flush=True)
            else:
                for row in rows:
                    print(f"{batch.epoch:x}:{batch.seq}{' snapshot' if batch.snapshot else ''} {row['type']} "
                          f"{' '.join(h[:16] for h in row.get('block_hashes', []))}", flush=True)
            if args.batches and batches >= args.batches:
                stream.cancel()
                break
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise NotAvailable("event stream not available on this server (it predates SubscribeEvents); "
                               "`kvctl top` polls Stats instead") from None
        if error.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            raise from_rpc_error(error, "SubscribeEvents") from None
    data = {"batches": batches, "events": events, "epoch": last[0], "last_seq": last[1]}
    return data, f"{batches} batches, {events} events (epoch {last[0]:x}, last seq {last[1]}; resume with --from-seq {last[1] + 1})"


def _event_row(event: pb.KVEvent) -> dict:
    kind = event.WhichOneof("event")
    body = getattr(event, kind)
    row: dict = {"type": {"block_stored": "BlockStored", "block_removed": "BlockRemoved",
                          "all_blocks_cleared": "AllBlocksCleared"}[kind]}
    if kind != "all_blocks_cleared":
        row["block_hashes"] = [h.hex() for h in body.block_hashes]
    if kind == "block_stored":
        row.update(parent_block_hash=body.parent_block_hash.hex(), token_ids=list(body.token_ids),
                   block_size=body.block_size)
    return row


COMMANDS: dict[str, Callable[[Ctl, argparse.Namespace], tuple[dict, str]]] = {
    "stats": cmd_stats, "sessions": cmd_sessions, "sequences": cmd_sequences, "block-table": cmd_block_table,
    "health": cmd_health, "drain": cmd_drain, "events": cmd_events,
}


# ---------------------------------------------------------------------------------------------- output helpers
def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):,.2f} MiB"


def _table(rows: Sequence[tuple[str, str]]) -> str:
    """Name / value rows (rich, plain text: no colour, no box)."""
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for name, value in rows:
        table.add_row(name, value)
    return _text(table)


def _columns(header: Sequence[str], lines: Sequence[Sequence[Any]]) -> str:
    """A table with a header; the first column left-aligned, the rest right-aligned (rich, plain text)."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for i, name in enumerate(header):
        table.add_column(str(name), justify="left" if i == 0 else "right", no_wrap=True)
    for line in lines:
        table.add_row(*map(str, line))
    return _text(table)


def _text(table: Table) -> str:
    """A rich table as plain text: wide enough not to wrap (kvctl's output is often piped), no trailing blanks."""
    out = io.StringIO()
    console = Console(file=out, width=max(100, shutil.get_terminal_size().columns), color_system=None,
                      force_terminal=False, highlight=False)
    console.print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()).strip("\n")


# ---------------------------------------------------------------------------------------------- entry point
def version() -> str:
    try:
        return importlib.metadata.version("kvpool")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _target_options(suppress: bool) -> credentials.SecretSafeParser:
    """The options every command takes, before or after its name. The copy on the subcommands has no defaults
    (SUPPRESS), so ``kvctl --target X stats`` is not reset by the subcommand's own default."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    common = credentials.SecretSafeParser(add_help=False, allow_abbrev=False)
    common.add_argument("--target", default=default(os.environ.get("KVPOOL_TARGET", "127.0.0.1:50051")),
                        help="server address: HOST:PORT or unix:PATH (env KVPOOL_TARGET; default 127.0.0.1:50051)")
    common.add_argument("--unix-socket", metavar="PATH", default=default(None),
                        help="the server's unix socket (same as --target unix:PATH)")
    common.add_argument("--timeout", type=float, default=default(10.0), help="deadline of each RPC in seconds (default 10)")
    common.add_argument("--json", action="store_true", default=default(False), help="print JSON instead of text")
    credentials.add_options(common, suppress=suppress)
    refuse_foreign_flags(common, "kvctl", CLIENT_TARGET_FLAGS)
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _target_options(suppress=True)
    parser = credentials.SecretSafeParser(prog="kvctl", description=__doc__,
                                          parents=[_target_options(suppress=False)],
                                          formatter_class=argparse.RawDescriptionHelpFormatter,
                                          allow_abbrev=False)  # no prefix of a flag stands for it (cli_flags)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("stats", parents=[common], allow_abbrev=False, help="pool occupancy")
    sub.add_parser("sessions", parents=[common], allow_abbrev=False, help="live sessions")
    p = sub.add_parser("sequences", parents=[common], allow_abbrev=False, help="live sequences")
    p.add_argument("--session", type=lambda t: int(t, 0), default=0, help="only this session's (0x... or decimal)")
    p = sub.add_parser("block-table", parents=[common], allow_abbrev=False, help="one sequence's page table")
    p.add_argument("seq_id", type=int)
    p = sub.add_parser("health", parents=[common], allow_abbrev=False, help="gRPC health status")
    p.add_argument("--service", default="", help="service name ('' for the server as a whole)")
    drain = sub.add_parser("drain", parents=[common], allow_abbrev=False, help="drain the server: NOT_SERVING, no new sessions (admin)")
    drain.add_argument("--wait", type=float, default=0.0, metavar="S", help="wait up to S seconds for it to empty; exit 5, naming what is still live, if it does not")
    drain.add_argument("--resume", action="store_true", help="undo a drain: SERVING again, new sessions taken")
    p = sub.add_parser("events", parents=[common], allow_abbrev=False, help="follow the server's KV event stream (admin with auth)")
    p.add_argument("--from-seq", type=int, default=None, help="resume at this batch (else: a snapshot first)")
    p.add_argument("--batches", type=int, default=0, help="stop after this many batches (0: follow)")
    p.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: follow until Ctrl-C)")
    p.add_argument("--zmq", metavar="ENDPOINT", default="",
                   help="follow the ZMQ PUB socket of --kv-events-publish instead (no gRPC; needs pyzmq, msgpack)")
    p.add_argument("--replay", metavar="ENDPOINT", default="",
                   help="with --zmq and --from-seq: first replay the kept messages from that seq (--kv-events-replay)")
    p.add_argument("--topic", default="", help="with --zmq: only this topic (kv@<pod>@<model>; a prefix filters)")
    p = sub.add_parser("top", parents=[common], allow_abbrev=False, help="live view, refreshed in place")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--iterations", type=int, default=0, help="stop after this many refreshes (0: until Ctrl-C)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.unix_socket:
        args.target = f"unix:{args.unix_socket}"
    args.exit_code = EXIT_OK
    if args.command == "events" and args.zmq:  # vLLM's wire: no gRPC connection (kvctl_zmq.py)
        from kvpool_client import kvctl_zmq

        try:
            data, text = kvctl_zmq.follow(args)
        except kvctl_zmq.ZmqUnavailable as exc:
            return _fail(args, EXIT_NOT_AVAILABLE, str(exc))
        except KeyboardInterrupt:
            return 130
        print(json.dumps(data, indent=1) if args.json else text)
        return EXIT_OK
    try:
        diagnose.check_target(args.target)
        creds = credentials.from_args(args).for_target(args.target)
    except (ValueError, CredentialsError) as exc:
        return _fail(args, EXIT_USAGE, str(exc))
    ctl = Ctl(args.target, args.timeout, creds)
    try:
        ctl.connect()
        if args.command == "top":
            from kvpool_client.kvctl_top import run_top

            return run_top(ctl.client, args)
        data, text = COMMANDS[args.command](ctl, args)
    except ConnectionError as exc:
        return _fail(args, EXIT_NO_SERVER, str(exc))
    except NotAvailable as exc:
        return _fail(args, EXIT_NOT_AVAILABLE, str(exc))
    except (UnauthenticatedError, PermissionDeniedError) as exc:
        return _fail(args, EXIT_ERROR, f"{exc}; {_auth_advice(exc, creds)}")
    except KVPoolClientError as exc:
        return _fail(args, EXIT_ERROR, str(exc))
    except KeyboardInterrupt:
        return 130
    finally:
        ctl.close()
    print(json.dumps(data, indent=1) if args.json else text)
    return args.exit_code


def _auth_advice(exc: KVPoolClientError, creds: Credentials) -> str:
    """What to do about a refusal, from what this kvctl sent."""
    if isinstance(exc, PermissionDeniedError):
        return "this command needs an admin token (role = \"admin\" in the server's tokens file)"
    if creds.token is None:
        return ("the server asks for a token (--auth-tokens): give --token-file FILE (env KVPOOL_TOKEN_FILE) or set "
                "KVPOOL_TOKEN")
    return f"the server does not know the token from {creds.where.get('token')} (mistyped, or revoked)"


def _fail(args: argparse.Namespace, code: int, message: str) -> int:
    if args.json:
        print(json.dumps({"error": message, "exit_code": code, "target": args.target}))
    print(f"kvctl {args.command}: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
