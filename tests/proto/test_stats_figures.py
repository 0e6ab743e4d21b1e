"""Issue 33.3: each stats figure is declared once -- the pool's in core/pool_figures.py, the host tier's in
offload/tier_stats.py; the core's tier stats, the proto mapping and the metrics are made from those declarations, and
what cannot be -- typed records and the wire -- is checked here: a figure one of them misses (or one that only it
has) fails."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client.types import HostTierStats as ClientHostTierStats
from kvpool_client.types import PoolStats as ClientPoolStats
from kvpool_server.core.pool_figures import POOL_FIGURES
from kvpool_server.offload.tier_stats import TIER_FIGURES
from kvpool_server.core.types import PoolStats
from kvpool_server.service.metrics import PoolCollector

DOCS = Path(__file__).resolve().parents[2] / "docs"
POOL_NAMES = {f.name for f in POOL_FIGURES}
NOT_FIGURES = {"block_bytes", "tenants", "host_tier"}  # StatsResponse's and the client's: an argument, two records


def test_every_figure_has_one_source_and_unique_names():
    for f in TIER_FIGURES:
        assert [bool(f.read), bool(f.copies), bool(f.per_block)].count(True) == 1, f
        assert bool(f.stat) == bool(f.read), f
        assert f.kind in ("counter", "gauge"), f
    for names in ([f.proto for f in TIER_FIGURES if f.proto], [f.stat for f in TIER_FIGURES if f.stat],
                  [f.metric for f in (*POOL_FIGURES, *TIER_FIGURES) if f.metric], [f.name for f in POOL_FIGURES]):
        assert len(names) == len(set(names))


def test_the_proto_host_tier_stats_holds_exactly_the_declared_fields():
    assert {field.name for field in pb.HostTierStats.DESCRIPTOR.fields} == {f.proto for f in TIER_FIGURES if f.proto}


def test_the_clients_host_tier_stats_holds_exactly_the_declared_fields():
    assert {field.name for field in dataclasses.fields(ClientHostTierStats)} == \
        {f.proto for f in TIER_FIGURES if f.proto}


def test_pool_stats_fields_are_exactly_the_declared_ones():
    fields = {field.name for field in dataclasses.fields(PoolStats)}
    properties = {name for name, value in vars(PoolStats).items() if isinstance(value, property)}
    tier_fields = {name for name in fields if name.startswith("host_tier_")}
    assert tier_fields == {f.stat for f in TIER_FIGURES if f.stat}
    assert {f.per_block for f in TIER_FIGURES if f.per_block} <= tier_fields
    assert fields - tier_fields == POOL_NAMES - properties  # every plain field declared, nothing more
    assert POOL_NAMES <= fields | properties  # a declared ratio is a property (utilization, ...)


def test_the_proto_stats_response_and_the_clients_pool_stats_hold_exactly_the_declared_fields():
    assert {field.name for field in pb.StatsResponse.DESCRIPTOR.fields} == POOL_NAMES | NOT_FIGURES
    assert {field.name for field in dataclasses.fields(ClientPoolStats)} == POOL_NAMES | NOT_FIGURES


def test_every_declared_metric_is_exported_and_documented():
    families = {family.name for family in PoolCollector(lambda: PoolStats(0, 0, 0, 0, 0, 0, 0, 0, 16),
                                                        block_bytes=64).collect()}
    documented = set(re.findall(r"kvpool_[a-z_]+", (DOCS / "metrics.md").read_text()))
    for f in (*POOL_FIGURES, *TIER_FIGURES):
        if f.metric:
            assert f.metric in families, f.metric
            assert f.metric in documented or f.metric + "_total" in documented, f.metric
