"""What a load-generator process keeps per live request: its sequences (beams, samples) and their KV history."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool_client.loadgen.chat import ChatConversation


@dataclass
class Seq:
    """One live sequence. ``history`` says who wrote which positions: [writer, start, stop) segments, the writer
    being a seq_id or a pseudo writer (a shared prompt, a conversation), so the expected KV is a function of it.
    Decode steps write as ``writer`` (the seq_id by default) and, with token ids, append ids of ``token_stream``."""

    seq_id: int
    name: int  # stable within its request (the beam rule ranks by it; server ids vary between runs)
    length: int
    target_len: int
    history: list[list[int]]  # [writer seq_id, start, stop): who wrote which positions
    last_slot: int = -1
    request_index: int = -1
    writer: int = -1  # whose KV pattern its decode steps write; -1: its own seq_id
    token_stream: int = -1  # the token-id stream of its decode steps (workload.stream_token_ids)

    def __post_init__(self) -> None:
        if self.writer < 0:
            self.writer = self.seq_id


@dataclass
class Request:
    """A request in flight: its live sequences; for a shared-prefix request the shared prompt and the physical
    blocks holding it (for resident copies); for a chat turn its conversation and turn."""

    index: int
    seqs: dict[int, Seq] = field(default_factory=dict)
    steps: int = 0
    next_name: int = 0
    corrupted: bool = False
    prompt_id: int = -1
    held_since: float = 0.0  # monotonic time before it registered: it may hold prefix blocks from then on
    prefix_block_ids: list[int] | None = None  # the shared prompt's full blocks, in order (shared-prefix)
    prefix_blocks_cached: int = 0  # how many of them RegisterSequence found cached
    conversation: ChatConversation | None = None
    turn: int = 0
