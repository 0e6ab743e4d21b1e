"""Beam search on a ``DecodeEngine``: beams are sequences; a beam chosen by several successors is forked (its
blocks shared), and the next append copies the shared last block (copy-on-write: on the server for the kvpool
variant, in ``LocalBlockCache`` for the in-process one); the prompt goes through the prefix cache (``add_prompt``).
The same interface as ``hf_llama.PagedBeams`` and ``DenseBeams``, so ``hf_llama.beam_search`` drives all three."""

from __future__ import annotations

import torch

from kvpool_client.integrations.engine import DecodeEngine
from kvpool_client.integrations.hf_llama import continue_beams


class EngineBeams:
    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine
        self.seqs: list[int] = []

    def start(self, prompt: torch.Tensor) -> torch.Tensor:
        """The prompt registered with its token ids (its cached run taken), the rest prefilled."""
        tokens = prompt.tolist()
        seq, cached = self.engine.add_prompt(tokens)
        self.seqs = [seq]
        return self.engine.prefill([seq], [tokens[cached:]])[0]

    def step(self, parents: list[int], tokens: list[int]) -> torch.Tensor:
        """Beam i continues beam ``parents[i]`` with ``tokens[i]``; logits [W, V] (a copy)."""
        new = self.seqs = continue_beams(self.seqs, parents, self.engine.fork, self.engine.free)
        return self.engine.decode(new, tokens).clone()

    def close(self) -> None:
        self.engine.free(self.seqs)
        self.seqs = []
        self.engine.check_errors()
