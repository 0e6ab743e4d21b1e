"""The fast path's record layout: one shared-memory segment per channel, what the server (kvpool_server/fastpath)
and the client (kvpool_client/fastpath.py) both read. docs/fast-path.md has the picture.

    offset 0                 control   32 int64 words (256 B): the handshake words, each side's on its own line
    offset 256               request   area_bytes: a 128-byte header (16 int64 words), then the arrays
    offset 256 + area_bytes  reply     area_bytes: a 128-byte header (16 int64 words), then the arrays

Control words (``CTL_*``): the client writes ``CTL_REQ_SEQ`` (after the whole request) and ``CTL_CLIENT_PARKED``;
the server writes the rest. A request is published by raising ``CTL_REQ_SEQ`` to the previous value + 1; its reply
by setting ``CTL_REP_SEQ`` to the same number, after the whole reply. Nothing in the segment is trusted by the
server: it copies the header into Python ints and the arrays into its own memory, checks every count against the
area before it reads, and serves a request only when ``CTL_REQ_SEQ`` is exactly its last seq + 1.

Arrays follow their header in the order listed, each starting on an 8-byte boundary (``align8``).
"""

from __future__ import annotations

import mmap

import numpy as np

MAGIC = 0x6B76_6670_0001  # "kvfp", version 1
CONTROL_BYTES = 256
HEADER_BYTES = 128
HEADER_WORDS = HEADER_BYTES // 8

# control words (int64 indices)
CTL_MAGIC = 0
CTL_GENERATION = 1
CTL_AREA_BYTES = 2
CTL_REQ_SEQ = 8  # client's cache line
CTL_CLIENT_PARKED = 9
CTL_REP_SEQ = 16  # server's cache line
CTL_SERVER_PARKED = 17
CTL_FENCED = 18  # nonzero: the channel is closed (its session ended, or the server stops); see FENCED_*

FENCED_SESSION_ENDED = 1
FENCED_SERVER_STOPPING = 2
FENCED_PROTOCOL = 3  # the client broke the protocol (a request seq out of order)

# ops
OP_REGISTER = 1
OP_APPEND = 2
OP_FORK = 3
OP_FREE = 4
OP_REGISTER_MANY = 5
OP_STEP = 6  # a Free, an AppendToken and a RegisterSequences in one record (kvpool.fastpath_step)
OP_NAMES = {OP_REGISTER: "RegisterSequence", OP_APPEND: "AppendToken", OP_FORK: "Fork", OP_FREE: "Free",
            OP_REGISTER_MANY: "RegisterSequences", OP_STEP: "Step"}

# request header words
#   register: ARG0 = seq_id (0: the server assigns), ARG1 = public_prefix_len; arrays: tokens (the prompt), extra
#   append:   ids, counts (one for all, or one each), tokens (token ids, or none)
#   fork:     ARG0 = parent, ARG1 = num_children; arrays: ids (the children's chosen ids)
#   free:     ids
#   register many (RegisterSequences, N prompts): ids = each prompt's cache_extra_key length (N); counts = each
#             prompt's token count, then each prompt's public_prefix_len (2N); tokens = the prompts concatenated;
#             extra = the keys concatenated
#   step:     a Free, an AppendToken, a RegisterSequences (each optional), in that order: see kvpool.fastpath_step
REQ_OP = 0
REQ_REQUEST_ID = 1
REQ_GENERATION = 2
REQ_N_IDS = 3
REQ_N_COUNTS = 4
REQ_N_TOKENS = 5
REQ_ARG0 = 6
REQ_ARG1 = 7
REQ_EXTRA_LEN = 8  # register's cache_extra_key bytes
REQ_SEQ = 9  # the CTL_REQ_SEQ this record is for

# reply header words
#   arrays: message (utf-8, MSG_LEN bytes), slots int64, new block ids int32, copies int32 [c, 2], children uint64
#   register many: slots = each prompt's num_cached_tokens (N); new block ids = their cached blocks concatenated
#             (prompt i's num_cached_tokens[i] // block size); children = the seq ids (N)
REP_SEQ = 0
REP_CODE = 1  # the canonical status code (gRPC's numbers); 0: OK
REP_REASON = 2  # REASONS index
REP_MSG_LEN = 3
REP_VALUE0 = 4  # register: seq_id; free: blocks freed; register many: the block size
REP_VALUE1 = 5  # register: num_cached_tokens
REP_N_SLOTS = 6
REP_N_NEW = 7
REP_N_COPIES = 8
REP_N_CHILDREN = 9

REASONS = ("", "session-not-found", "server-restarted", "quota-exceeded")  # the kvpool-error reasons, by index
MAX_MESSAGE_BYTES = 4096  # an error message is cut to this


def align8(n: int) -> int:
    return (n + 7) & ~7


def segment_bytes(area_bytes: int) -> int:
    return CONTROL_BYTES + 2 * area_bytes


def request_bytes(n_ids: int, n_counts: int, n_tokens: int, extra_len: int = 0) -> int:
    """The request area a record needs."""
    return HEADER_BYTES + 8 * n_ids + align8(4 * n_counts) + align8(4 * n_tokens) + align8(extra_len)


def reply_bytes(msg_len: int, n_slots: int, n_new: int, n_copies: int, n_children: int) -> int:
    """The reply area a record needs."""
    return (HEADER_BYTES + align8(msg_len) + 8 * n_slots + align8(4 * n_new) + 8 * n_copies + 8 * n_children)


def append_reply_bound(n_ids: int, n_tokens: int, block_size: int) -> int:
    """The largest reply an append of ``n_ids`` sequences and ``n_tokens`` tokens in all can have (an OK one: an
    error's is at most HEADER_BYTES + MAX_MESSAGE_BYTES). A slot per token. New blocks: ``c`` tokens appended to a
    sequence whose last block is partial and shared (a fork's) take that block's copy plus the blocks after it --
    at most ``(c + 2 * block_size - 2) // block_size``, never more than ``c`` -- so at most
    ``min(n_tokens, n_tokens // block_size + 2 * n_ids)`` in all. Copies: at most one per sequence (and per
    token). ``block_size`` 1 when it is not known: the bound still holds for every block size."""
    new = min(n_tokens, n_tokens // block_size + 2 * n_ids)
    return HEADER_BYTES + 8 * n_tokens + ((4 * new + 7) & ~7) + 8 * min(n_ids, n_tokens)  # reply_bytes', inline


def register_many_request_bytes(n_prompts: int, n_tokens: int, extra_len: int) -> int:
    """The request area a register-many record of ``n_prompts`` prompts needs."""
    return request_bytes(n_prompts, 2 * n_prompts, n_tokens, extra_len)


def register_many_reply_bytes(n_prompts: int, n_blocks: int) -> int:
    """The reply area a register-many reply of ``n_blocks`` cached block ids in all needs. A prompt of ``t``
    tokens has at most ``(t - 1) // block_size`` cached blocks (all but its last token), so the reply of a record
    that fits its request area always fits an area as big: 4 bytes a block against 4 a token."""
    return reply_bytes(0, n_prompts, n_blocks, 0, n_prompts)


class Views:
    """NumPy views of one mapped segment: ``ctl`` (int64 control words), ``req``/``rep`` (the areas' headers as int64
    words), ``req_area``/``rep_area`` (the areas' bytes); ``ctl_words``/``req_words``/``rep_words``: the same words
    as memoryviews (a word read or written as a Python int in ~30 ns, a NumPy element's ~100 ns: the per-record
    header work and the serving thread's look at every channel's seq). ``release()`` drops them so the mapping can
    close."""

    def __init__(self, mapping: mmap.mmap, area_bytes: int) -> None:
        self.area_bytes = area_bytes
        self.ctl = np.frombuffer(mapping, np.int64, CONTROL_BYTES // 8, 0)
        self.req_area = np.frombuffer(mapping, np.uint8, area_bytes, CONTROL_BYTES)
        self.rep_area = np.frombuffer(mapping, np.uint8, area_bytes, CONTROL_BYTES + area_bytes)
        self.req = self.req_area[:HEADER_BYTES].view(np.int64)
        self.rep = self.rep_area[:HEADER_BYTES].view(np.int64)
        whole = memoryview(mapping)
        self.ctl_words = whole[:CONTROL_BYTES].cast("q")
        self.req_words = whole[CONTROL_BYTES:CONTROL_BYTES + HEADER_BYTES].cast("q")
        self.rep_words = whole[CONTROL_BYTES + area_bytes:CONTROL_BYTES + area_bytes + HEADER_BYTES].cast("q")

    def release(self) -> None:
        # dropped, not ``memoryview.release()``d: a reader still holding one (an exchange parked while its client
        # closes) keeps it valid, as it keeps a NumPy view, and the mapping closes once the last one goes
        del self.ctl, self.req_area, self.rep_area, self.req, self.rep, self.ctl_words, self.req_words, self.rep_words


def open_segment(name: str, size: int) -> mmap.mmap:
    """Map an existing segment (no resource_tracker: see kvpool.shm)."""
    from kvpool.shm import open_shm

    return open_shm(name, size)
