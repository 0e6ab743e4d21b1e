"""A declared figure (core/pool_figures.py, offload/tier_stats.py) as its Prometheus family: the one place a figure's
``kind`` picks the family's type."""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


def figure_family(figure: Any, value: float | None) -> Metric:
    """``figure``'s family (its ``metric``, ``kind`` and ``help``), with ``value`` (None: no sample, describe)."""
    family = CounterMetricFamily if figure.kind == "counter" else GaugeMetricFamily
    return family(figure.metric, figure.help, value=value)
