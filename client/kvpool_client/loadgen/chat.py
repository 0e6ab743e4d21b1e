"""The multi-turn chat workload (``--workload chat``): each turn's prompt is the whole conversation so far. Pure.

    turn 0  [user 0]                                         -> output 0, then 1 sealing token
    turn 1  [user 0][output 0][user 1]                       -> output 1, then 1 sealing token
    turn 2  [user 0][output 0][user 1][output 1][user 2]     -> output 2, ...
            '--- sealed by turn 1: cached ---'

Conversation c is one token stream: the id at position p is a function of (seed, c, p), user messages and outputs
alike, so a turn's prompt repeats the previous turn's tokens exactly and starts with its sealed blocks. Its KV is
keyed by a pseudo writer (CHAT_WRITER_BASE + c) and the position, so a cached block holds exactly the bytes this
turn would have written. A turn decodes one token past its output -- the next user message's first token, the
same id and KV the next turn will have there -- so the block its last output token filled is sealed (sealing
happens with a sequence's next append, docs/prefix-caching.md) before it is freed.

User messages are ``--turn-tokens`` long; output lengths come from ``--lengths`` (one draw per turn).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpool_client.loadgen.workload import LengthDistribution, stream_token_ids

CHAT_STREAM_BASE = 1 << 41  # conversation c's token ids: stream CHAT_STREAM_BASE + c
CHAT_WRITER_BASE = 1 << 59  # conversation c's KV pattern: writer CHAT_WRITER_BASE + c (never a server seq_id)
SEALING_TOKENS = 1  # decoded past the output so the last full block is sealed before Free


@dataclass(frozen=True)
class ChatConversation:
    """Conversation ``index``: ``len(output_lens)`` turns, each a user message of ``turn_tokens`` then an output."""

    index: int
    turn_tokens: int
    output_lens: tuple[int, ...]

    @property
    def num_turns(self) -> int:
        return len(self.output_lens)

    def end_len(self, turn: int) -> int:
        """Tokens of the conversation once turn ``turn``'s output is done (0 before turn 0)."""
        return sum(self.turn_tokens + out for out in self.output_lens[: turn + 1])

    def prompt_len(self, turn: int) -> int:
        """Turn ``turn``'s prompt: every earlier message and output, then its own user message."""
        return self.end_len(turn - 1) + self.turn_tokens

    def sequence_len(self, turn: int) -> int:
        """The length turn ``turn``'s sequence reaches: prompt, output and the sealing token."""
        return self.end_len(turn) + SEALING_TOKENS

    def expected_cached_tokens(self, turn: int, block_size: int) -> int:
        """What RegisterSequence returns for the turn when nothing was evicted: the previous turn sealed every block
        it filled (its sealing token sealed the last), i.e. ``end_len(turn - 1) // block_size`` blocks, and the
        server leaves at least one prompt token uncached (the prompt is longer than that, so no cut)."""
        if turn == 0:
            return 0
        sealed = self.end_len(turn - 1) // block_size * block_size
        return min(sealed, (self.prompt_len(turn) - 1) // block_size * block_size)

    @property
    def max_total_len(self) -> int:
        return self.sequence_len(self.num_turns - 1)


def make_chat_conversation(
    seed: int, index: int, dist: LengthDistribution, num_turns: int, turn_tokens: int
) -> ChatConversation:
    """Conversation ``index`` of a run: its output lengths depend only on (seed, index)."""
    rng = np.random.default_rng([seed, index, 2])
    _, output_lens = dist.sample(rng, num_turns)
    return ChatConversation(index, turn_tokens, output_lens)


def conversation_token_ids(seed: int, index: int, start: int, stop: int) -> np.ndarray:
    """Token ids of conversation ``index`` at positions [start, stop)."""
    return stream_token_ids(seed, CHAT_STREAM_BASE + index, start, stop)


def conversation_writer(index: int) -> int:
    """The pseudo writer whose pattern conversation ``index``'s KV holds (pattern.token_keys)."""
    return CHAT_WRITER_BASE + index


def max_conversation_len(dist: LengthDistribution, num_turns: int, turn_tokens: int) -> int:
    """An upper bound of a conversation's last sequence: each output is at most the distribution's max_len."""
    return num_turns * (turn_tokens + dist.max_len) + SEALING_TOKENS
