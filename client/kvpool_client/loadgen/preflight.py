"""What kvpool-loadgen checks before it starts workers, and how it explains a run that did not complete.

- ``connect(client, target, timeout, creds)``: a short wait for the server, then what happened (diagnose.py): a
  draining server, a TLS mismatch, nothing listening -- instead of a silent 30 s wait on a wrong ``--target``; a
  failure that waiting cannot cure (TLS, a certificate) fails at once.
- ``check_attach(target, creds, tenant)``: every process maps the pool; a tenant without ``may_attach`` is told so
  before any process starts.
- ``pool_fit(...)``: can one request fit the pool at all (else there is no point starting), and can all those in
  flight at once (else they will queue on RESOURCE_EXHAUSTED and may stall)?
- ``explain_incomplete(summary)``: the lines that say *why* fewer requests completed than asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpool_client import diagnose
from kvpool_client.attach import NOT_ALLOWED
from kvpool_client.client import KVPoolClient
from kvpool_client.credentials import Credentials
from kvpool_client.errors import AttachNotAllowedError, DeadlineExceededError, KVPoolClientError, UnavailableError

CONNECT_TIMEOUT_S = 5.0


class NoServerError(RuntimeError):
    """Nothing answered at the target; the message says where we looked and what to check."""


class NoRoomError(RuntimeError):
    """Not even one request fits the pool: the run could never complete one."""


def connect(client: KVPoolClient, target: str, timeout: float = CONNECT_TIMEOUT_S,
            creds: Credentials | None = None) -> None:
    """Return once the server says SERVING; NoServerError saying why not (a failure that waiting cannot cure --
    TLS, a certificate, a path without unix: -- at once, else after ``timeout``)."""
    creds = creds or Credentials()
    problem = _probe(target, creds, min(timeout, 3.0))
    if problem is not None and problem.permanent:
        raise NoServerError(problem.message)
    try:
        client.wait_until_serving(timeout=timeout)
        return
    except (DeadlineExceededError, UnavailableError):
        pass
    try:
        status = client.health(timeout=min(timeout, 3.0))
    except KVPoolClientError:
        status = None
    if status is not None:
        raise NoServerError(
            f"the kvpool-server at {target} answers but is {status}: it is draining (kvctl drain) or shutting down, "
            "and takes no new sessions. Wait until it serves again, or give another server's --target") from None
    problem = _probe(target, creds, min(timeout, 3.0))
    why = problem.message if problem is not None else "it did not answer SERVING"
    raise NoServerError(f"no kvpool-server at {target} after {timeout:g} s: {why} (--connect-timeout waits longer "
                        "for one that is starting)") from None


def _probe(target: str, creds: Credentials, timeout: float) -> diagnose.Problem | None:
    channel = creds.channel(target)
    try:
        return diagnose.probe(channel, target, timeout, creds.tls, creds.tls_server_name)
    finally:
        channel.close()


def check_attach(target: str, creds: Credentials, tenant: str = "") -> None:
    """AttachNotAllowedError when the server does not give this token's tenant the pool's mapping: every process
    writes and verifies KV through the mapped pool."""
    with KVPoolClient(target, session=False, **creds.client_kwargs()) as client:
        desc = client.describe_pool()
    if desc.backend in ("host", "gpu") and not (desc.shm_name or desc.cuda_ipc_handle):
        who = f"tenant {tenant!r}" if tenant else "the tenant of this token"
        raise AttachNotAllowedError(
            f"{who} may not attach the pool, and --kv-path attach writes and verifies KV through the mapped pool: "
            f"grant it may_attach = true in the server's tokens file (then SIGHUP the server), run as a tenant "
            f"that may, or use --kv-path grpc (or auto). ({NOT_ALLOWED})", code=AttachNotAllowedError.code,
            method="DescribePool")


@dataclass(frozen=True)
class PoolFit:
    blocks_per_request: int  # most blocks one request can hold: max_len tokens in each of its sequences
    blocks_in_flight: int  # all requests in flight at their longest
    num_blocks: int

    @property
    def one_fits(self) -> bool:
        return self.blocks_per_request <= self.num_blocks

    @property
    def all_fit(self) -> bool:
        return self.blocks_in_flight <= self.num_blocks

    def advice(self) -> str:
        return ("give the server a bigger pool (--pool-bytes / KVPOOL_POOL_BYTES), or ask for less: "
                "--concurrency, --max-len, --beam-width / --num-samples")


def pool_fit(num_blocks: int, block_size: int, max_len: int, sequences_per_request: int, concurrency: int) -> PoolFit:
    """Upper bounds (beams share their prompt's blocks, so these overstate beam and parallel modes)."""
    per_request = -(-max_len // block_size) * sequences_per_request
    return PoolFit(per_request, per_request * concurrency, num_blocks)


def too_small_message(fit: PoolFit, max_len: int) -> str:
    return (f"the pool is too small for this load: one request may need {fit.blocks_per_request} blocks "
            f"({max_len} tokens a sequence) but the pool has {fit.num_blocks}; {fit.advice()}")


def explain_incomplete(summary: dict[str, Any]) -> list[str]:
    """Why ``run.completions`` fell short of ``config.completions`` (empty when it did not)."""
    cfg, run = summary["config"], summary["run"]
    if summary.get("interrupted"):
        return [f"interrupted by {summary['interrupted']} after {run['wall_s']:.1f} s: {run['completions']} of "
                f"{cfg['completions']} requests completed and verified; the {run.get('stopped_in_flight', 0)} in "
                "flight were left unfinished (closing the workers' sessions freed their sequences)"]
    if run["completions"] >= cfg["completions"]:
        return []
    lines = [f"only {run['completions']} of {cfg['completions']} requests completed:"]
    errors = " ".join(summary.get("worker_errors", []))
    quota_hit = {name: u for name, u in (summary.get("tenants") or {}).items() if u.get("quota_refusals")}
    for name, u in quota_hit.items():
        lines.append(f"  tenant {name} was refused {u['quota_refusals']} times by its quota (max_blocks="
                     f"{u['max_blocks']}, peak {u['peak_blocks']}): its {u['processes']} process(es) wait only for "
                     "its own blocks; raise its quota in the tokens file, or ask for less (-c, --max-len)")
    exhausted = not quota_hit and ("RESOURCE_EXHAUSTED" in errors or run.get("resource_exhausted_retries", 0) > 0)
    mem = summary.get("memory", {})
    num_blocks = summary["end"]["blocks_total"]
    fit = pool_fit(num_blocks, cfg["block_size"], cfg["max_len"], cfg["sequences_per_request"], cfg["concurrency"])
    if exhausted or (not fit.all_fit and not quota_hit):
        lines.append(f"  the pool ran out of blocks (RESOURCE_EXHAUSTED): {cfg['concurrency']} requests in flight "
                     f"may hold up to {fit.blocks_in_flight} blocks, the pool has {num_blocks} "
                     f"(peak use {mem.get('peak_used_blocks', '?')})")
        lines.append(f"  {fit.advice()}")
    if "DEADLINE_EXCEEDED" in errors or "UNAVAILABLE" in errors:
        lines.append("  calls timed out or the server went away: see the worker failures above (--timeout)")
    if summary.get("worker_errors") and len(lines) == 1:
        lines.append("  a worker failed: see the worker failures above")
    if len(lines) == 1:
        lines.append("  no worker reported an error: see the server's log")
    return lines
