"""A gRPC call's fair share (``service.fair``, fair_share.py): its turn before it runs, its cost after.

    take_turn(service, call, request)   a session over its share awaits until it is within it (at most
                                        MAX_TURN_WAIT_S, and never past the call's deadline): the event loop
                                        serves the other sessions meanwhile; a RegisterSequence of a long prompt
                                        has its hashes made on the hasher (prompt_hasher.py), awaited here, so
                                        the loop does only the locked part -> ``HashedRegister``; so has a
                                        RegisterSequences of more than CHUNK_BLOCKS blocks in all (one job a
                                        prompt, queued at once) -> ``HashedRegisterMany``
    charge(service, call, request, s)   the seconds the loop spent on the call (parse, serve, encode), charged to
                                        its session (or its tenant's key without a live one)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.core.errors import QuotaExceededError
from kvpool_server.service import register_batch
from kvpool_server.service.fair_share import key_of
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.prompt_hasher import HashJob
from kvpool_server.service.register_batch import PromptToRegister
from kvpool_server.service.scope import Call

MAX_TURN_WAIT_S = 0.05  # the longest one call waits for its session's share (then it runs: no session starves)


class HashedRegister:
    """A RegisterSequenceRequest whose prompt the hasher has hashed: ``prompt`` (the job's copy) and ``hashes``
    go to ``service.register``; every other field is the request's."""

    def __init__(self, request: pb.RegisterSequenceRequest, job: HashJob) -> None:
        self.request = request
        self.prompt = job.prompt
        self.hashes = job.result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.request, name)


class HashedRegisterMany:
    """A RegisterSequencesRequest whose prompts the hasher has hashed: ``prompts`` and ``hashes`` (each prompt's,
    None where its job did not finish: ``register_many`` hashes that one itself) go to ``service.register_many``;
    every other field is the request's."""

    def __init__(self, request: pb.RegisterSequencesRequest, prompts: list[PromptToRegister],
                 jobs: list[HashJob]) -> None:
        self.request = request
        self.prompts = prompts
        self.hashes = [job.result for job in jobs]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.request, name)


def call_key(service: KVPoolService, call: Call, request: Any) -> int:
    return key_of(getattr(request, "session_id", 0), call.caller.tenant_id, service.guard.sessions)


async def take_turn(service: KVPoolService, call: Call, request: Any, max_wait_s: float) -> Any:
    """The request, once its session is within its share (a ``HashedRegister`` for a long prompt, a
    ``HashedRegisterMany`` for a long batch)."""
    key = call_key(service, call, request)
    wait = service.fair.wait_s(key)
    if wait > 0:
        await asyncio.sleep(min(wait, MAX_TURN_WAIT_S, max(0.0, max_wait_s)))
    tenant = call.caller.tenant_id
    if isinstance(request, pb.RegisterSequencesRequest):
        prompts = [PromptToRegister(p.prompt_token_ids, p.public_prefix_len, p.cache_extra_key)
                   for p in request.prompts]
        if not service.hasher.is_long_batch(sum(len(p.prompt_token_ids) for p in prompts)):
            return request
        try:  # None: the service refuses the batch itself; the hasher full: hashed in the call, as before
            jobs = await _hashed(service, lambda done: register_batch.submit_hashing(
                service.hasher, key, tenant, prompts, service.max_batch, service.limits.max_tokens_per_call, done))
        except QuotaExceededError:
            return request
        return request if jobs is None else HashedRegisterMany(request, prompts, jobs)
    if not isinstance(request, pb.RegisterSequenceRequest) or not service.hasher.is_long(
            len(request.prompt_token_ids)):
        return request
    jobs = await _hashed(service, lambda done: _one(service.hasher.submit(
        key, tenant, np.asarray(request.prompt_token_ids, dtype=np.uint32), request.public_prefix_len,
        request.cache_extra_key, done)))
    return request if jobs is None else HashedRegister(request, jobs[0])  # None: a register refuses it itself


def _one(job: HashJob | None) -> list[HashJob] | None:
    return None if job is None else [job]


async def _hashed(service: KVPoolService,
                  submit: Callable[[Callable[[HashJob], None]], list[HashJob] | None]) -> list[HashJob] | None:
    """``submit(done)``'s jobs once the hasher has done them (``done`` runs on the hasher's thread, for the last),
    the loop serving the other calls meanwhile; None when nothing was queued. Cancelled: the jobs go before their
    next chunk."""
    loop = asyncio.get_running_loop()
    hashed = loop.create_future()

    def resolve() -> None:
        if not hashed.done():
            hashed.set_result(None)

    def done(job: HashJob) -> None:  # on the hasher's thread
        loop.call_soon_threadsafe(resolve)

    jobs = submit(done)
    if jobs is None:
        return None
    try:
        await hashed
    except BaseException:
        for job in jobs:
            service.hasher.cancel(job)
        raise
    return jobs


def charge(service: KVPoolService, call: Call, request: Any, seconds: float) -> None:
    service.fair.charge(call_key(service, call, request), seconds)
