"""serve.py's Prometheus metrics, served as text at GET /metrics (prometheus-client), named after vLLM's with the
prefix `step5:`. Recorded on rank 0 only: by the HTTP side (requests by endpoint and outcome, connections) and by the
engine loop after each step, from one host timestamp per step taken after the step has read its tokens, so recording
adds no device synchronisation to the decode path.
"""
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "step5:"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{id}", "/health", "/metrics")
# seconds; the decode step of a whole rank is ~5 ms on an H200, a first token 50 ms to seconds
LATENCY = (0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
           40.0, 80.0, 160.0, 640.0)


class Metrics:
    """The server's metrics in a registry of their own (a second server in one process keeps its own)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = PREFIX
        self.requests = Counter(p + "requests", "HTTP requests by endpoint and outcome (ok, an error code such as "
                                "invalid_value or overloaded, disconnected, engine_error)", ["endpoint", "outcome"],
                                registry=r)
        self.finished = Counter(p + "request_finish", "Engine requests (one per choice) by finish reason",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of the requests submitted", registry=r)
        self.cached_tokens = Counter(p + "prompt_tokens_cached", "Prompt tokens reused from a slot's cache",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens the engine generated", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=LATENCY, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Between a request's tokens (each token of a step "
                             "that gave several counts the step's time shared out)", buckets=LATENCY, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "From a request's arrival to its end",
                             buckets=LATENCY, registry=r)
        self.step = Histogram(p + "engine_step_seconds", "One engine step (prefill chunk and decode step)",
                              buckets=LATENCY, registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests holding a slot", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting for a slot", registry=r)
        self.slots = Gauge(p + "num_slots", "Slots of the engine (--max-batch)", registry=r)
        self.startup = Gauge(p + "startup_seconds", "Start-up time by phase: load (the weights), engine (kernel "
                             "builds, warm-up, graphs), total (to serving)", ["phase"], registry=r)
        self.prefix = {name: Counter(p + f"prefix_cache_{name}", text, registry=r) for name, text in (
            ("hits", "Requests that copied a prefix from the prefix store"),
            ("misses", "Requests that found no prefix in the prefix store worth copying"),
            ("evictions", "Prefixes the prefix store dropped for room, least recently used first"))}
        self.prefix_bytes = Gauge(p + "prefix_cache_bytes", "Bytes of the prefix store holding prefixes",
                                  registry=r)
        self._prefix_seen = {}
        self.connections = Gauge(p + "http_connections", "Open HTTP connections", registry=r)
        self.closed = Counter(p + "http_connections_closed", "Connections the server closed: refused (at "
                              "--max-connections, none idle), evicted (idle, for a new one at the cap), timeout "
                              "(no request within the header timeout)", ["reason"], registry=r)

    def prefix_store(self, stats: dict, used: int):
        """The engine's prefix store after a step: its counts (prefix_cache.PrefixStore.stats, running totals) and the
        bytes it holds."""
        for name, c in self.prefix.items():
            c.inc(stats[name] - self._prefix_seen.get(name, 0))
            self._prefix_seen[name] = stats[name]
        self.prefix_bytes.set(used)

    def request(self, path: str, outcome: str):
        """One HTTP request's end: its endpoint (a path of no endpoint counts as "other") and outcome."""
        path = "/v1/models/{id}" if path.startswith("/v1/models/") else path
        self.requests.labels(path if path in ENDPOINTS else "other", outcome).inc()

    def text(self) -> tuple[bytes, str]:
        """-> (the metrics in Prometheus' text format, its content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
