"""Prometheus metrics of `fleet serve`, in a registry of their own (one per process, never global)."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from reconciler.planning.plan import SUMMARY_ORDER, Plan


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("fleet_requests_total", "Client requests by cluster and HTTP status",
                                ["cluster", "status"], registry=self.registry)
        self.streams = Gauge("fleet_streams_in_flight", "Streams being relayed now", registry=self.registry)
        self.connections = Gauge("fleet_client_connections", "Client connections open now", registry=self.registry)
        self.connections_dropped = Counter("fleet_client_connections_dropped_total",
                                           "Client connections closed to stay within the cap: evicted (idle the "
                                           "longest) or refused (all busy)", ["reason"], registry=self.registry)
        self.relay_bytes = Counter("fleet_relay_bytes_total", "Bytes relayed to clients", registry=self.registry)
        self.node_up = Gauge("fleet_node_up", "1 when the node answered the last heartbeat", ["node"],
                             registry=self.registry)
        self.beat_seconds = Histogram("fleet_heartbeat_seconds", "Time one heartbeat took (all nodes)",
                                      registry=self.registry, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))

        self.pending = Gauge("fleet_pending_changes", "Changes the latest heartbeat's plan holds, by action: the "
                             "fleet no longer matches its file while any is above 0", ["action"],
                             registry=self.registry)
        for action in SUMMARY_ORDER:
            self.pending.labels(action.value).set(0)
        # The status page's figures per cluster (serve/ui): how long a relayed request waited for its
        # answer's head (a stream's first byte), and the completion tokens answers state in `usage`.
        self.latency = Histogram("fleet_request_seconds", "Time from a relayed request to its answer's head (a "
                                 "stream's first byte), by cluster", ["cluster"], registry=self.registry,
                                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.tokens = Counter("fleet_completion_tokens_total", "Completion tokens of relayed answers, as their usage "
                              "states them (a stream's only when it asks for stream_options.include_usage)",
                              ["cluster"], registry=self.registry)
        self.draining = Gauge("fleet_members_draining", "Cluster members taken out of routing by an apply now",
                              registry=self.registry)

    def planned(self, plan: Plan) -> None:
        for action in SUMMARY_ORDER:
            self.pending.labels(action.value).set(plan.count(action))

    def answered(self, cluster: str, body: bytes) -> None:
        """Counts the completion tokens a relayed answer's `usage` states (for a stream: its last
        pieces, where the usage chunk comes before [DONE])."""
        found = _COMPLETION_TOKENS.findall(body)
        if found:
            self.tokens.labels(cluster).inc(int(found[-1]))

    def render(self) -> bytes:
        return generate_latest(self.registry)


_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
