"""The decode engine over a tensor-parallel pool (``--tensor-parallel N``): ``DecodeEngine`` with ``TPLlama`` as
its forward, rank r over its shard (``client.attach(rank=r)``) with its heads' slice of the weights::

    control path (once, not per rank): Append / Fork / Free on the one server -> slots, one block table a sequence
    data path, rank r = 0..N-1:        write_layer + paged_decode on shard r at THOSE slots; partial sums to rank 0

    engine = TPDecodeEngine.on_pool(model, client)     # the server's DescribePool says N, each shard's heads/device
    engine.generate(prompts, 32); engine.close()

Prefix caching as ``DecodeEngine``'s (one register, one cached run and one table for every rank; the suffix's
attention on each rank reads its shard of the run): the prefill's writes on every rank's device are waited for
before the append that seals them.

Ranks sit where the server put their shards (``--tp-devices``: rank r on the r-th device; without it all on device
0; the host backend: all on the CPU). ``placement`` says which, logged at start: with every rank on one device the
engine runs the same code as on N devices (one process driving N ranks in a loop), and a decode step is one CUDA
graph as for ``DecodeEngine``; with ranks on several devices the step runs eagerly (a captured graph would cross
devices), each rank's work on its own device, the partial sums moved to rank 0's device. The model (embedding,
norms, LM head: replicated, not split) must be on rank 0's device.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from kvpool_client.integrations.engine import DecodeEngine
from kvpool_client.integrations.streamed_appends import control_path
from kvpool_client.integrations.tp_llama import TPLlama
from kvpool_client.kernels import torch_views

log = logging.getLogger(__name__)


class TPDecodeEngine(DecodeEngine):
    """``DecodeEngine`` over ``shards`` (rank order, rank r holding KV heads ``heads[r]`` of every block). The block
    tables, slots and scratch sequence are the base engine's, shared by every rank; ``blocks`` is rank 0's shard."""

    PREFILL_GRAPHS = False  # its prefill runs eagerly, rank by rank

    def __init__(self, model: Any, control: Any, shards: Sequence[torch.Tensor], heads: Sequence[range], *,
                 pools: Sequence[Any] = (), **kwargs: Any) -> None:
        self.shards, self.heads, self.pools = list(shards), list(heads), list(pools)
        self.devices = [s.device for s in self.shards]
        self.one_device = len(set(self.devices)) == 1
        home = next(model.parameters()).device
        if home != self.devices[0]:
            raise ValueError(f"the model is on {home}, rank 0's shard on {self.devices[0]}: move the model there")
        if not self.one_device:
            kwargs["graph_sizes"] = []  # eager: a graph would cross devices
        n = len(self.shards)
        self.placement = (f"{n} ranks on one device ({self.devices[0]}): the code of {n} devices, run on one"
                          if self.one_device else f"{n} ranks on {', '.join(map(str, self.devices))}: eager")
        log.info("tensor-parallel engine: %s", self.placement)
        super().__init__(model, control, self.shards[0], **kwargs)

    def _paged_model(self, model: Any, helpers: str) -> TPLlama:
        return TPLlama(model, self.shards, self.heads, helpers)

    def _write_devices(self) -> list[torch.device]:
        """Every rank's device: a prefill's writes there are waited for before the append that seals them."""
        return list(dict.fromkeys(self.devices))

    @classmethod
    def on_pool(cls, model: Any, client: Any, append_stream: bool | None = None, **kwargs: Any) -> TPDecodeEngine:
        """Every rank's shard of ``client``'s server mapped here (one ``attach(rank=r)`` each), the control calls
        through ``client`` as for ``DecodeEngine.on_pool``. A pool of one rank is the N = 1 case."""
        from kvpool_client.integrations.hf_llama import layout_for  # noqa: PLC0415

        desc = client.describe_pool()
        layout = desc.layout  # the full layout
        expected = layout_for(model.config, layout.block_size, layout.dtype, layout.kv_layout)
        if expected != layout:
            raise ValueError(f"the server's layout {layout} does not hold this model's KV ({expected})")
        pools = [client.attach(rank=r) for r in range(desc.tensor_parallel)]
        control = control_path(client, append_stream)
        return cls(model, control, [torch_views.blocks(p) for p in pools], [s.heads for s in desc.shards],
                   pools=pools, live_check=lambda: pools[0]._check_server(), **kwargs)

    @classmethod
    def in_process(cls, model: Any, num_blocks: int, block_size: int = 16, **kwargs: Any) -> DecodeEngine:
        raise NotImplementedError("the tensor-parallel engine runs over a server's sharded pool (on_pool); "
                                  "DecodeEngine.in_process is the in-process baseline")

    def check_errors(self) -> None:
        """Raise if a kernel of any rank was given a slot outside the pool since the last check (synchronizes)."""
        flags = self.model.errors()
        bad = [int(flag.item()) for flag in flags]
        for flag in flags:
            flag.zero_()
        super().check_errors()
        if any(bad):
            raise ValueError(f"a KV op was given slots outside [0, {self.num_slots}); they were skipped")

    def close(self) -> None:
        """``DecodeEngine.close``, then every rank's shard unmapped."""
        super().close()
        for pool in self.pools:
            pool.close()
