"""Issue 33.3: each figure of the host tier is declared once (core/tier_stats.py); the core's stats, the proto
mapping and the metrics are made from that declaration, and what cannot be -- typed records and the wire -- is
checked here: a figure one of them misses (or one that only it has) fails."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client.types import HostTierStats as ClientHostTierStats
from kvpool_server.core.tier_stats import TIER_FIGURES
from kvpool_server.core.types import PoolStats
from kvpool_server.service.metrics import PoolCollector

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_figure_has_one_source_and_unique_names():
    for f in TIER_FIGURES:
        assert [bool(f.read), bool(f.copies), bool(f.per_block)].count(True) == 1, f
        assert bool(f.stat) == bool(f.read), f
        assert f.kind in ("counter", "gauge"), f
    for names in ([f.proto for f in TIER_FIGURES if f.proto], [f.metric for f in TIER_FIGURES if f.metric],
                  [f.stat for f in TIER_FIGURES if f.stat]):
        assert len(names) == len(set(names))


def test_the_proto_host_tier_stats_holds_exactly_the_declared_fields():
    assert {field.name for field in pb.HostTierStats.DESCRIPTOR.fields} == {f.proto for f in TIER_FIGURES if f.proto}


def test_the_clients_host_tier_stats_holds_exactly_the_declared_fields():
    assert {field.name for field in dataclasses.fields(ClientHostTierStats)} == \
        {f.proto for f in TIER_FIGURES if f.proto}


def test_pool_stats_host_tier_fields_are_exactly_the_declared_ones():
    tier_fields = {field.name for field in dataclasses.fields(PoolStats) if field.name.startswith("host_tier_")}
    assert tier_fields == {f.stat for f in TIER_FIGURES if f.stat}
    assert {f.per_block for f in TIER_FIGURES if f.per_block} <= tier_fields


def test_every_declared_metric_is_exported_and_documented():
    families = {family.name for family in PoolCollector(lambda: PoolStats(0, 0, 0, 0, 0, 0, 0, 0, 16),
                                                        block_bytes=64).collect()}
    documented = set(re.findall(r"kvpool_[a-z_]+", (DOCS / "metrics.md").read_text()))
    for f in TIER_FIGURES:
        if f.metric:
            assert f.metric in families, f.metric
            assert f.metric in documented or f.metric + "_total" in documented, f.metric
