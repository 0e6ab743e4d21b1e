"""The ZMQ publisher's counters as Prometheus metrics (docs/metrics.md), read from the publisher at every scrape.

Wiring: ``main.serve`` registers ``ZmqEventsCollector(publisher)`` on the server's registry when both
``--metrics-address`` and ``--kv-events-publish`` are given.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvpool_server.zmq_events.publisher import ZmqEventPublisher


class ZmqEventsCollector(Collector):
    def __init__(self, publisher: ZmqEventPublisher) -> None:
        self.publisher = publisher

    def collect(self) -> Iterable[Metric]:
        p = self.publisher
        yield CounterMetricFamily("kvpool_kv_events_zmq_messages", "Messages sent on the KV events PUB socket",
                                  value=p.num_messages)
        yield CounterMetricFamily(
            "kvpool_kv_events_zmq_dropped_batches",
            "Event batches dropped from the publisher's queue (it fell behind): each drop leads to a restate",
            value=p.num_dropped)
        yield CounterMetricFamily(
            "kvpool_kv_events_zmq_restates",
            "Restates sent: AllBlocksCleared then every cached block (the start, a full queue, a lost batch)",
            value=p.num_restates)
        yield CounterMetricFamily(
            "kvpool_kv_events_zmq_withheld_blocks",
            "Blocks stored and not published (an extra key, or a tenant without a model name)",
            value=p.wire.num_withheld)
        replays = p.replay_counts()
        yield CounterMetricFamily("kvpool_kv_events_zmq_replay_requests",
                                  "Requests read on the replay socket (malformed ones too)", value=replays["requests"])
        yield CounterMetricFamily("kvpool_kv_events_zmq_replay_malformed",
                                  "Malformed replay requests (ignored; logged once per interval)",
                                  value=replays["malformed"])
        yield CounterMetricFamily(
            "kvpool_kv_events_zmq_replay_refused",
            "Replay requests answered with the end marker at once: too many peers with a replay in progress",
            value=replays["refused"])
        yield CounterMetricFamily(
            "kvpool_kv_events_zmq_replay_truncated",
            "Replays ended before a message larger than --kv-events-replay-queued-bytes", value=replays["truncated"])
        yield GaugeMetricFamily(
            "kvpool_kv_events_zmq_replay_held_bytes",
            "Replay bytes the server holds for its peers (at most --kv-events-replay-queued-bytes)",
            value=p.replay_budget.used)
        yield GaugeMetricFamily("kvpool_kv_events_zmq_queued_bytes",
                                "Estimated bytes of batches waiting for the publisher thread", value=p.queued_bytes)
