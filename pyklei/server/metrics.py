"""The server's Prometheus metrics (prometheus_client), in a registry of their own so that two
apps in one process (tests) do not share counters.

    pyklei_requests_total{endpoint, status}          requests answered, by route and HTTP status
    pyklei_prompt_tokens_total                       prompt tokens of finished requests
    pyklei_generated_tokens_total                    tokens generated for them
    pyklei_queue_depth                               requests waiting for a sequence slot (engine)
    pyklei_running_sequences                         sequences being decoded now (engine)
    pyklei_num_requests_waiting                      the same two under vLLM's names, the gauges a
    pyklei_num_requests_running                      router reads (as vllm:num_requests_*)
    pyklei_kv_cache_usage_perc                       fraction (0-1) of the KV cache slots' positions
                                                     the running requests hold (vllm's name)
    pyklei_prefix_cache_queries_total                prompt tokens looked up in cached prefixes
    pyklei_prefix_cache_hits_total                   of those, tokens found (a slot's or the prefix
                                                     cache's; hit rate: their ratio, as vLLM's)
    pyklei_prefix_cache_restored_tokens_total        of the hits, tokens the prefix cache restored
                                                     into a slot (pyklei.runtime.prefix_cache)
    pyklei_prefix_cache_bytes                        its blocks' memory now, and its budget
    pyklei_prefix_cache_capacity_bytes               (serve --cache-ram; 0: off)
    pyklei_parallel_slots                            the engine's n_parallel
    pyklei_cancelled_total                           sequences the engine cancelled (disconnects)
    pyklei_failed_total                              sequences that failed alone (a sampling or
                                                     decoding error; the batch went on)
    pyklei_drafted_tokens_total                      speculative decoding (serve --lookup or
    pyklei_accepted_tokens_total                     --draft-model): tokens drafted for finished
                                                     sequences, and of those accepted (acceptance
                                                     rate: their ratio)
    pyklei_time_to_first_token_seconds               histogram, per request: submitted -> first
                                                     token, queue wait included
    pyklei_decode_tokens_per_second                  histogram, per request (after the first token)
    pyklei_model_loaded{model}                       1 while the model is resident, else 0

The engine figures are read when /metrics is scraped, summed over the models' engines
(model_registry.ModelRegistry.stats: the gauges over the loaded ones, the counters over every
engine the server has run, so that they never go down when a model is unloaded).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPS_BUCKETS = (1, 2, 5, 10, 20, 35, 50, 75, 100, 150, 200, 300, 500, 1000)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/health", "/metrics", "/")


class _EngineCollector:
    """Figures read from the engines at scrape time (`engines`: a ModelRegistry)."""

    def __init__(self, engines):
        self.engines = engines

    def collect(self):
        s = self.engines.stats()
        for name, key, text in (("pyklei_queue_depth", "queued", "requests waiting for a slot"),
                                ("pyklei_running_sequences", "running", "sequences being decoded"),
                                ("pyklei_parallel_slots", "n_parallel", "sequence slots")):
            yield GaugeMetricFamily(name, text, value=s[key])
        yield GaugeMetricFamily("pyklei_num_requests_waiting", "requests waiting for a slot",
                                value=s["queued"])
        yield GaugeMetricFamily("pyklei_num_requests_running", "requests being decoded",
                                value=s["running"])
        yield GaugeMetricFamily("pyklei_kv_cache_usage_perc", "fraction of the KV cache slots' "
                                "positions held by running requests",
                                value=s["kv_used_tokens"] / max(1, s["kv_capacity_tokens"]))
        for name, key, text in (
                ("pyklei_prefix_cache_queries", "prefix_cache_queries", "prompt tokens looked up"),
                ("pyklei_prefix_cache_hits", "prefix_cache_hits", "prompt tokens found cached"),
                ("pyklei_prefix_cache_restored_tokens", "prefix_cache_restored",
                 "prompt tokens the prefix cache restored into a slot")):
            yield CounterMetricFamily(name, text, value=s.get(key, 0))
        for name, key, text in (
                ("pyklei_prefix_cache_bytes", "prefix_cache_bytes", "prefix cache memory used"),
                ("pyklei_prefix_cache_capacity_bytes", "prefix_cache_capacity_bytes",
                 "prefix cache memory budget")):
            yield GaugeMetricFamily(name, text, value=s.get(key, 0))
        yield CounterMetricFamily("pyklei_cancelled", "sequences cancelled (client disconnects, "
                                  "shutdown)", value=s["cancelled"])
        yield CounterMetricFamily("pyklei_failed", "sequences that failed alone while sampling "
                                  "or decoding", value=s["failed"])
        yield CounterMetricFamily("pyklei_drafted_tokens", "tokens drafted by speculative "
                                  "decoding for finished sequences", value=s["drafted_tokens"])
        yield CounterMetricFamily("pyklei_accepted_tokens", "drafted tokens the model accepted",
                                  value=s["accepted_tokens"])
        loaded = GaugeMetricFamily("pyklei_model_loaded", "1 while the model is resident",
                                   labels=["model"])
        for m in self.engines.models():
            loaded.add_metric([m["id"]], float(m["status"] == "loaded"))
        yield loaded


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engines):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pyklei_requests", "HTTP requests answered",
                                ("endpoint", "status"), registry=r)
        self.prompt_tokens = Counter("pyklei_prompt_tokens", "prompt tokens of finished requests",
                                     registry=r)
        self.generated_tokens = Counter("pyklei_generated_tokens", "tokens generated",
                                        registry=r)
        self.ttft = Histogram("pyklei_time_to_first_token_seconds",
                              "time from submission to the first token (queue wait included)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.decode_tps = Histogram("pyklei_decode_tokens_per_second",
                                    "decode speed of a request after its first token",
                                    buckets=TPS_BUCKETS, registry=r)
        r.register(_EngineCollector(engines))

    def request(self, path: str, status: int) -> None:
        self.requests.labels(path if path in ENDPOINTS else "other", str(status)).inc()

    def generation(self, lasts, ttft: float | None) -> None:
        """A finished request's figures: the last GenerationResponse of each of its choices
        (the prompt counted once), and the time from its submission to its first token as the
        server saw it (queue wait included)."""
        self.prompt_tokens.inc(lasts[0].prompt_tokens)
        for last in lasts:
            self.generated_tokens.inc(last.generation_tokens)
            if last.generation_tokens > 1:
                self.decode_tps.observe(last.generation_tps)
        if ttft is not None:
            self.ttft.observe(ttft)

    def render(self) -> bytes:
        return generate_latest(self.registry)
