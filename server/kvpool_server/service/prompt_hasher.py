"""PromptHasher: a long prompt's chain hashes, computed on a thread of their own ("kvpool-hasher") in chunks, a fair
share of the server per session -- not on the event loop, not on the fast-path thread.

A register's per-token work is its prompt's chain hashes (``PrefixReuse.prompt_hashes``: one sha256 of ~130 bytes a
block, ~1.7 us each, and hashlib keeps the GIL for data under 2 KiB): 3.5 ms for 32k tokens, all of it holding the
GIL. Done where the call arrives, it stalled every other caller of that thread (a fast-path record waits behind it)
and of the process (the event loop waits for the GIL up to the 5 ms switch interval). Here::

    transport: job = hasher.submit(key, tenant, prompt, ...)      prompts over CHUNK_BLOCKS blocks only
               (gRPC: awaits job's future; fast path: serves the other channels, this one once job.done)
    hasher:    the job of the least-used session (FairShare) whose session is within its share; CHUNK_BLOCKS
               blocks of it -- HASHER_CHUNK_BLOCKS, the same time in C as CHUNK_BLOCKS in Python -- (and of that
               session's next jobs, while the chunk has blocks left: a batch's short prompts share a chunk; at most
               CHUNK_BLOCKS jobs); that time charged to its session; the C loop holds no GIL while it hashes (a
               thread woken for a light call takes it at once); the Python loop holds it, and gives it up for real
               after the chunk while another session is active (a sleep of GIL_GAP_S)
    transport: service.register(..., prompt_hashes=job.hashes)    the locked part only

The hashes are those ``prompt_hashes`` gives (the same chain, cut into chunks: ``reusable_hashes`` of slices with
the parent carried over), of the job's own copy of the prompt (the client cannot change it meanwhile), and the
transport passes that same copy to ``register``. A prompt that ``register`` would refuse is not hashed
(``submit`` answers None and the call goes on as before: refused, unchanged).

Bounded: the queued jobs hold at most MAX_QUEUED_TOKENS tokens (4 bytes each, and 32 bytes a block of hashes);
``submit`` and ``submit_many`` refuse past that (RESOURCE_EXHAUSTED, nothing applied, nothing queued). A job
cancelled (its channel closed, its call cancelled) is dropped before its next chunk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from kvpool_server.core.block_hash import NATIVE, NONE_HASH, chain_hashes
from kvpool_server.core.errors import KVPoolError, QuotaExceededError
from kvpool_server.core.prefix_reuse import PrefixReuse
from kvpool_server.service.fair_share import FairShare

logger = logging.getLogger(__name__)
CHUNK_BLOCKS = 32  # a prompt of at most this many blocks is hashed inline (~55 us in Python, ~6 us in C)
# Blocks hashed between two looks at the others: ~55 us either way (C hashes a block in ~0.17 us, Python in ~0.65;
# one core of the development machine, block size 16). The C loop releases the GIL over a chunk this long.
HASHER_CHUNK_BLOCKS = CHUNK_BLOCKS * (8 if NATIVE else 1)
GIL_GAP_S = 20e-6  # after a Python chunk, while others are active: the GIL released this long (really ~70 us)
MAX_PACE_S = 0.005  # an over-share session's chunk waits at most this long before the share is looked at again
MAX_QUEUED_TOKENS = 16 << 20  # the queued prompts' tokens, all jobs together (64 MiB of tokens + 32 MiB of hashes)


def _nothing(job: HashJob) -> None:
    pass


class HashJob:
    """One prompt's chain hashes, chunk after chunk. ``hashes`` is complete once ``done``; ``prompt`` is the copy
    the transport registers."""

    __slots__ = ("key", "prompt", "salt", "num_public", "extra", "block_size", "num_blocks", "hashes", "done",
                 "cancelled", "on_done")

    def __init__(self, key: int, prompt: np.ndarray, salt: bytes, num_public: int, extra: bytes, block_size: int,
                 on_done: Callable[[HashJob], None]) -> None:
        self.key = key
        self.prompt = prompt
        self.salt = salt
        self.num_public = num_public
        self.extra = extra
        self.block_size = block_size
        self.num_blocks = max(0, (prompt.size - 1) // block_size)  # reusable_hashes: all but the last token's
        self.hashes: list[bytes] = []
        self.done = False
        self.cancelled = False
        self.on_done = on_done

    @property
    def result(self) -> list[bytes] | None:
        """The prompt's hashes once complete (None: not done, or hashing failed -- register hashes it itself)."""
        return self.hashes if self.done and len(self.hashes) == self.num_blocks else None

    def step(self, num_blocks: int) -> None:
        """Hash the next ``num_blocks`` blocks (the chain carried on from the last one hashed)."""
        first, bs = len(self.hashes), self.block_size
        last = min(self.num_blocks, first + num_blocks)
        self.hashes += chain_hashes(self.prompt[first * bs:last * bs], bs, self.salt,
                                    self.hashes[-1] if first else NONE_HASH, self.extra,
                                    max(0, self.num_public - first))
        self.done = last == self.num_blocks


class PromptHasher:
    """The hasher's jobs by session key (each key's in order) and its thread, started on the first job.
    Invariant: ``queued_tokens`` is the sum of the queued jobs' prompt sizes, at most MAX_QUEUED_TOKENS."""

    def __init__(self, prefix: PrefixReuse, block_size: int, fair: FairShare) -> None:
        self.prefix = prefix
        self.block_size = block_size
        self.fair = fair
        self.cond = threading.Condition()
        self.jobs: dict[int, deque[HashJob]] = {}
        self.queued_tokens = 0
        self.thread: threading.Thread | None = None
        self.running = True

    def is_long_batch(self, num_tokens: int) -> bool:
        """A batch (RegisterSequences, either transport) hashed here, not inline: more than CHUNK_BLOCKS full
        blocks in all may be hashed."""
        return CHUNK_BLOCKS < num_tokens // self.block_size

    def is_long(self, num_tokens: int) -> bool:
        """A prompt hashed here, not inline: more than CHUNK_BLOCKS blocks to hash, and no longer than a register
        takes (a longer one is refused by its size, before any per-token work: not copied here first)."""
        return CHUNK_BLOCKS < (num_tokens - 1) // self.block_size and num_tokens <= self.prefix.max_seq_len

    def submit(self, key: int, tenant: int | None, prompt_token_ids: Sequence[int] | np.ndarray,
               public_prefix_len: int, cache_extra_key: bytes,
               on_done: Callable[[HashJob], None]) -> HashJob | None:
        """Queue the prompt's hashes; ``on_done(job)`` runs on the hasher's thread once they are complete. None:
        a prompt ``register`` refuses (the caller registers it as before, to be refused with the same status)."""
        try:
            prompt, salt, num_public = self.prefix.hash_input(tenant, prompt_token_ids, public_prefix_len,
                                                              cache_extra_key)
        except (KVPoolError, IndexError):
            return None
        job = HashJob(key, np.array(prompt, dtype=np.uint32), salt, num_public, cache_extra_key, self.block_size,
                      on_done)
        with self.cond:
            if self.queued_tokens + prompt.size > MAX_QUEUED_TOKENS:
                raise QuotaExceededError(
                    f"the prompt hasher holds {self.queued_tokens} tokens of queued prompts (at most "
                    f"{MAX_QUEUED_TOKENS}): retry")
            self.jobs.setdefault(key, deque()).append(job)
            self.queued_tokens += prompt.size
            self._start()
            self.cond.notify()
        return job

    def _start(self) -> None:
        """Under ``cond``: the thread, started on the first job."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="kvpool-hasher", daemon=True)
            self.thread.start()

    def submit_many(self, key: int, tenant: int | None,
                    prompts: Sequence[tuple[Sequence[int] | np.ndarray, int, bytes]],
                    on_done: Callable[[HashJob], None]) -> list[HashJob] | None:
        """``submit`` of several prompts (token ids, public_prefix_len, cache_extra_key each) at once, all or none:
        one job each, queued in order under one hold (a session's jobs end in order: ``on_done`` runs once, for the
        last). None: one of them ``register`` refuses (nothing queued); QuotaExceededError: they would pass
        MAX_QUEUED_TOKENS (nothing queued)."""
        jobs: list[HashJob] = []
        for i, (tokens, public_prefix_len, extra) in enumerate(prompts):
            try:
                prompt, salt, num_public = self.prefix.hash_input(tenant, tokens, public_prefix_len, extra)
            except (KVPoolError, IndexError):
                return None
            jobs.append(HashJob(key, np.array(prompt, dtype=np.uint32), salt, num_public, extra, self.block_size,
                                on_done if i == len(prompts) - 1 else _nothing))
        total = sum(job.prompt.size for job in jobs)
        with self.cond:
            if self.queued_tokens + total > MAX_QUEUED_TOKENS:
                raise QuotaExceededError(
                    f"the prompt hasher holds {self.queued_tokens} tokens of queued prompts (at most "
                    f"{MAX_QUEUED_TOKENS}): retry")
            self.jobs.setdefault(key, deque()).extend(jobs)
            self.queued_tokens += total
            self._start()
            self.cond.notify()
        return jobs

    def cancel(self, job: HashJob) -> None:
        job.cancelled = True  # dropped before its next chunk (its memory with it)

    def stop(self) -> None:
        with self.cond:
            self.running = False
            self.cond.notify()

    # ---------------------------------------------------------------- the thread
    def _next(self) -> HashJob | None:
        """Under ``cond``: the first job of the least-used session that is within its share, cancelled jobs
        dropped; None when there is none (then wait)."""
        fair, best, best_usage = self.fair, None, 0.0
        for key in list(self.jobs):
            queue = self.jobs[key]
            while queue and queue[0].cancelled:
                self.queued_tokens -= queue.popleft().prompt.size
            if not queue:
                del self.jobs[key]
                continue
            usage = fair.usage(key)
            if best is None or usage < best_usage:
                best, best_usage = queue[0], usage
        return best

    def _run(self) -> None:
        while self.running:
            try:
                self._serve_one()
            except Exception:  # a bug here must not end the thread: every long register would wait for it
                logger.exception("prompt hasher: failed")
                time.sleep(0.01)

    def _serve_one(self) -> None:
        """Wait for a job whose turn it is; hash one chunk of it -- and of its session's next jobs while the chunk
        has blocks left (at most CHUNK_BLOCKS jobs); hand each over once complete."""
        fair = self.fair
        with self.cond:
            job = self._next()
            while self.running and (job is None or fair.pause_s(job.key) > 0):
                self.cond.wait(None if job is None else min(fair.pause_s(job.key), MAX_PACE_S))
                job = self._next()
            if not self.running or job is None:
                return
        key, started = job.key, time.perf_counter()
        budget, finished = HASHER_CHUNK_BLOCKS, []
        while job is not None:
            hashed = len(job.hashes)
            try:
                job.step(budget)
            except Exception:  # a bug: the job ends without its hashes (``result`` None: register hashes inline)
                logger.exception("prompt hasher: hashing failed")
                job.done = True
            budget -= len(job.hashes) - hashed
            if not job.done:
                break
            finished.append(job)
            job = self._done(job, budget > 0 and len(finished) < CHUNK_BLOCKS)
        fair.charge(key, time.perf_counter() - started, heavy=True)  # heavy: gives way to light work
        for job in finished:
            if not job.cancelled:
                try:
                    job.on_done(job)
                except Exception:  # its transport is gone (a stopped fast path, a closed loop): nobody waits
                    logger.debug("prompt hasher: a finished job's transport is gone", exc_info=True)
        if not NATIVE and fair.level() != float("inf"):  # others active: a thread waiting for the GIL takes it
            time.sleep(GIL_GAP_S)

    def _done(self, job: HashJob, more: bool) -> HashJob | None:
        """``job`` complete: off its session's queue; its session's next job not cancelled when ``more``."""
        with self.cond:
            queue = self.jobs.get(job.key)
            if queue and queue[0] is job:
                queue.popleft()
                self.queued_tokens -= job.prompt.size
            while more and queue and queue[0].cancelled:
                self.queued_tokens -= queue.popleft().prompt.size
            return queue[0] if more and queue else None

    def check_invariants(self) -> None:
        with self.cond:
            total = sum(j.prompt.size for q in self.jobs.values() for j in q)
            assert total == self.queued_tokens <= MAX_QUEUED_TOKENS, f"hasher: {total} != {self.queued_tokens}"
