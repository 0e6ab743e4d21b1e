"""How a load-generator process starts the prefix-caching workloads' requests: shared-prefix (plain or beam) and
chat turns. Each registers with its prompt's token ids, appends and writes only the part that is not cached, and
its decode steps append token ids, so full blocks are hashed and sealed (docs/prefix-caching.md).

``--no-prefix-cache`` runs the same requests the way a server without caching would be driven: a plain
RegisterSequence, the whole prompt appended (and written) without token ids, decode steps without ids. The KV
pattern is the same either way (keyed by the shared prompt or conversation and the position), so verification does
not change.

A shared-prefix request also records which physical blocks hold its shared prompt (one GetBlockTable after the
prefill) and from when to when, for the resident copies of each shared prompt (resident.py).
"""

from __future__ import annotations

import time
import numpy as np

from kvpool_client.loadgen.chat import (
    CHAT_STREAM_BASE,
    ChatConversation,
    conversation_token_ids,
    conversation_writer,
)
from kvpool_client.loadgen.pattern import kv_pattern, token_keys
from kvpool_client.loadgen.sequences import Request, Seq
from kvpool_client.loadgen.workload import (
    REQUEST_WRITER_BASE,
    SHARED_WRITER_BASE,
    beam_token_stream,
    make_shared_prefix_request,
    request_token_ids,
    shared_token_ids,
    stream_token_ids,
)
from kvpool_client.loadgen.worker_base import WorkerBase


class PrefixRequests(WorkerBase):
    """How a process starts the prefix-caching workloads' requests (the module docstring): a part of ``Worker``."""

    def _register_and_prefill(self, ids: np.ndarray) -> tuple[int, int, np.ndarray]:
        """RegisterSequence with the prompt (or, without caching, without it) and append the uncached rest.
        Returns (seq_id, num_cached_tokens, the new tokens' slots)."""
        if self.cfg.no_prefix_cache:
            seq_id, cached = self.timed("register", self.client.register), 0
        else:
            seq_id, cached = self.timed("register", self.client.register_prompt, ids)
        token_ids = None if self.cfg.no_prefix_cache else ids[cached:]
        result = self.prefill(seq_id, len(ids) - cached, token_ids)  # may raise PrefillDeferred: nothing counted
        self.counts["prompt_tokens"] += len(ids)
        self.counts["cached_tokens"] += cached
        self.counts["requests_with_hit"] += cached > 0
        self.used_blocks += cached // self.layout.block_size  # held again (approximate: the block may be shared)
        return seq_id, cached, result.slot_mapping

    def start_shared_prefix_request(self, index: int) -> Request:
        """One of the shared prompts + the request's own tokens; in beam mode forked into the beams after the
        prefill. The prompt's KV is a function of (prompt id or request index, position), not of the server's seq_id, so a
        cached block holds what this request would write."""
        cfg = self.cfg
        spec = make_shared_prefix_request(cfg.seed, index, self.dist, cfg.num_prompts, cfg.shared_tokens,
                                          cfg.unique_tokens)
        shared, prompt_len = spec.shared_len, spec.prompt_len
        ids = np.concatenate([shared_token_ids(cfg.seed, spec.prompt_id, 0, shared),
                              request_token_ids(cfg.seed, index, shared, prompt_len)])
        held_since = time.monotonic()
        root, cached, slots = self._register_and_prefill(ids)
        writer, own_writer = SHARED_WRITER_BASE + spec.prompt_id, REQUEST_WRITER_BASE + index
        keys = np.concatenate([token_keys(writer, min(cached, shared), shared),
                               token_keys(own_writer, max(cached, shared), prompt_len)])
        self.write_kv(slots, kv_pattern(keys, self.layout), [(root, cached, len(keys))])
        table = self.timed("prefix_blocks", self.client.block_table, root)
        request = Request(index, prompt_id=spec.prompt_id, held_since=held_since,
                          prefix_block_ids=table.block_ids[: shared // self.layout.block_size].tolist(),
                          prefix_blocks_cached=min(cached, shared) // self.layout.block_size)
        seq_ids = [root]
        if self.width > 1:
            seq_ids += self.timed("fork", self.client.fork, root, self.width - 1)
            self.counts["forks"] += self.width - 1
        for name, seq_id in enumerate(seq_ids):
            history = [[writer, 0, shared], [own_writer, shared, prompt_len]]
            request.seqs[seq_id] = Seq(seq_id, name, prompt_len, spec.max_total_len, history, request_index=index,
                                       token_stream=beam_token_stream(index, name))
        request.next_name = len(seq_ids)
        self.counts["sequences"] += len(seq_ids)
        return request

    def start_chat_turn(self, conversation: ChatConversation, turn: int) -> Request:
        """Turn ``turn`` of a conversation: the prompt is the conversation so far plus the new user message."""
        cfg, index = self.cfg, conversation.index
        prompt_len = conversation.prompt_len(turn)
        ids = conversation_token_ids(cfg.seed, index, 0, prompt_len)
        seq_id, cached, slots = self._register_and_prefill(ids)
        self.counts["expected_cached_tokens"] += conversation.expected_cached_tokens(turn, self.layout.block_size)
        writer = conversation_writer(index)
        self.write_kv(slots, kv_pattern(token_keys(writer, cached, prompt_len), self.layout),
                      [(seq_id, cached, prompt_len - cached)])
        request = Request(index, conversation=conversation, turn=turn, next_name=1)
        request.seqs[seq_id] = Seq(seq_id, 0, prompt_len, conversation.sequence_len(turn), [[writer, 0, prompt_len]],
                                   request_index=index, writer=writer,
                                   token_stream=CHAT_STREAM_BASE + index)
        self.counts["sequences"] += 1
        return request


def decode_token_ids(seed: int, seqs: list[Seq]) -> np.ndarray:
    """The id of each sequence's next token (one per sequence, in order), from its token stream."""
    return np.concatenate([stream_token_ids(seed, s.token_stream, s.length, s.length + 1) for s in seqs])
