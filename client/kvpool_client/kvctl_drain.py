"""kvctl drain: the Drain RPC (health NOT_SERVING, no new sessions), and ``--wait S`` until nothing is live.

A drain is done when no session and no sequence is left. Sessions end by themselves (their frontends close them,
or their leases run out); a session-less sequence (a client made with ``session=False``) lives until someone frees
it, so a drain with one never completes. ``--wait`` that runs out therefore fails (``EXIT_NOT_DRAINED``) and says
what is still live: each session (id, client name, sequences, blocks) and the session-less sequences (their
count, and the first ``MAX_LISTED`` ids), so the operator knows whom to stop or what to free.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client.pages import all_pages

EXIT_NOT_DRAINED = 5  # --wait ran out with sessions or sequences still live
POLL_S = 0.2
MAX_LISTED = 20  # session-less sequence ids named in the message / the JSON


def cmd_drain(call: Callable[[str, Any], Any], args: argparse.Namespace) -> tuple[dict, str]:
    """Drain; with ``--wait`` poll until nothing is live, or fail naming what still is (``args.exit_code``)."""
    if getattr(args, "resume", False):
        reply = call("Drain", pb.DrainRequest(resume=True))
        data = {"draining": False, "num_sessions": reply.num_sessions, "num_sequences": reply.num_sequences}
        return data, f"drain undone: serving new sessions again ({reply.num_sessions} sessions, " \
                     f"{reply.num_sequences} sequences live)"
    reply = call("Drain", pb.DrainRequest())
    deadline = time.monotonic() + args.wait
    while args.wait and _live(reply) and time.monotonic() < deadline:
        time.sleep(POLL_S)
        reply = call("Drain", pb.DrainRequest())
    drained = not _live(reply)
    data: dict[str, Any] = {"draining": True, "num_sessions": reply.num_sessions,
                            "num_sequences": reply.num_sequences, "drained": drained}
    text = (f"draining: health NOT_SERVING, no new sessions; {reply.num_sessions} sessions and "
            f"{reply.num_sequences} sequences live" + (" -- drained" if drained else ""))
    if args.wait and not drained:
        args.exit_code = EXIT_NOT_DRAINED
        data["still_live"] = still_live(call)
        text += f"\nnot drained after --wait {args.wait:g} s; still live:\n" + describe(data["still_live"])
    return data, text


def still_live(call: Callable[[str, Any], Any]) -> dict[str, Any]:
    """The live sessions, and the sequences that belong to none (they never end by themselves)."""
    sessions, _ = all_pages(call, "ListSessions", pb.ListSessionsRequest(), "sessions")
    sequences, _ = all_pages(call, "ListSequences", pb.ListSequencesRequest(), "sequences")
    sessionless = [s.seq_id for s in sequences if not s.session_id]
    return {
        "sessions": [{"session_id": s.session_id, "client_name": s.client_name, "num_sequences": s.num_sequences,
                      "num_blocks": s.num_blocks} for s in sessions],
        "num_sessionless_sequences": len(sessionless),
        "sessionless_seq_ids": sessionless[:MAX_LISTED],
    }


def describe(live: dict[str, Any]) -> str:
    lines = [f"  session {s['session_id']:#x} ({s['client_name'] or 'unnamed'}): {s['num_sequences']} sequences, "
             f"{s['num_blocks']} blocks" for s in live["sessions"]]
    n = live["num_sessionless_sequences"]
    if n:
        ids = ", ".join(map(str, live["sessionless_seq_ids"])) + (", ..." if n > MAX_LISTED else "")
        lines.append(f"  {n} session-less sequences (seq_id {ids}): they end only when freed "
                     "(Free, or a client's free())")
    return "\n".join(lines) or "  nothing listed (it ended while listing)"


def _live(reply: pb.DrainResponse) -> bool:
    return bool(reply.num_sessions or reply.num_sequences)
