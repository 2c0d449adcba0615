"""The simulator's /metrics: vLLM 0.32's own metric names, types, label sets and histogram buckets
(prometheus_client, as vLLM uses), for the subset a router or a dashboard reads."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from dpserve.sim.cache import PrefixCache
from dpserve.sim.engine import EngineObserver, GenerationRequest, RequestStats, SimEngine

TTFT_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
)
TTFT_BUCKETS += (40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS: tuple[float, ...] = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
)
LATENCY_BUCKETS += (480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")

# vLLM labels cache_config_info with every CacheConfig field; the sim fills the ones it models and
# gives the rest vLLM's defaults, so the label set is the same.
CACHE_CONFIG_DEFAULTS = {
    "_block_size_resolved": "True",
    "cache_dtype": "auto",
    "cache_hit_alignment_tokens": "None",
    "enable_mamba_shared_prefix_checkpoint": "False",
    "enable_prefix_caching": "True",
    "gpu_memory_utilization": "0.92",
    "hash_block_size": "None",
    "is_attention_free": "False",
    "kv_cache_dtype_skip_layers": "[]",
    "kv_cache_layout": "None",
    "kv_cache_memory_bytes": "None",
    "kv_offloading_backend": "native",
    "kv_offloading_size": "None",
    "kv_sharing_fast_prefill": "False",
    "mamba_block_size": "None",
    "mamba_cache_dtype": "auto",
    "mamba_cache_mode": "none",
    "mamba_page_size_padded": "None",
    "mamba_ssm_cache_dtype": "auto",
    "num_cpu_blocks": "None",
    "num_gpu_blocks_override": "None",
    "prefix_cache_retention_interval": "0",
    "prefix_caching_hash_algo": "sha256",
    "prefix_match_unit": "None",
    "replayssm_buffer_len": "16",
    "skip_page_size_padded": "None",
    "sliding_window": "None",
    "swa_bounded_replay": "True",
    "use_kda_recoverssm": "False",
    "use_replayssm": "False",
    "user_specified_block_size": "True",
}


class _Families:
    """Every metric family, once per registry; each engine's series are its children labelled engine="R"."""

    def __init__(self, registry: CollectorRegistry, cache: PrefixCache) -> None:
        labels = ("model_name", "engine")

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*labels, "finished_reason"),
            registry=registry,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LATENCY_BUCKETS,
        )
        self.cache_config = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            tuple(cache_config_labels(cache, 1, 0)),
            registry=registry,
        )


def cache_config_labels(cache: PrefixCache, max_num_seqs: int, rank: int) -> dict[str, str]:
    return {
        **CACHE_CONFIG_DEFAULTS,
        "block_size": str(cache.block_size),
        "effective_attention_block_size": str(cache.block_size),
        "num_gpu_blocks": str(cache.capacity),
        "kv_cache_size_tokens": str(cache.capacity * cache.block_size),
        "kv_cache_max_concurrency": str(float(max_num_seqs)),
        "engine": str(rank),
    }


class EngineMetrics(EngineObserver):
    """One engine's series, updated by that engine as requests move; gauges that are state (queue, KV usage)
    are read at scrape."""

    def __init__(self, families: _Families, model_name: str, rank: int, cache: PrefixCache, max_num_seqs: int) -> None:
        values = (model_name, str(rank))
        self._running = families.running.labels(*values)
        self._waiting = families.waiting.labels(*values)
        families.kv_usage.labels(*values).set_function(lambda: cache.usage)
        self.queries = families.queries.labels(*values)
        self.hits = families.hits.labels(*values)
        self.prompt_tokens = families.prompt_tokens.labels(*values)
        self.generation_tokens = families.generation_tokens.labels(*values)
        self.success = {reason: families.success.labels(*values, reason) for reason in FINISHED_REASONS}
        self.ttft = families.ttft.labels(*values)
        self.itl = families.itl.labels(*values)
        self.e2e = families.e2e.labels(*values)
        self.queue_time = families.queue_time.labels(*values)
        families.cache_config.labels(**cache_config_labels(cache, max_num_seqs, rank)).set(1)

    def watch(self, engine: SimEngine) -> None:
        """Read the engine's queue state at scrape time rather than on every change."""
        self._running.set_function(lambda: engine.running)
        self._waiting.set_function(lambda: engine.waiting)

    # EngineObserver
    def on_admitted(self, request: GenerationRequest, stats: RequestStats) -> None:
        self.queries.inc(len(request.prompt_ids))
        self.hits.inc(stats.cached_tokens)
        self.prompt_tokens.inc(len(request.prompt_ids))
        self.queue_time.observe(stats.admitted - stats.arrived)

    def on_token(self, stats: RequestStats, gap_s: float | None) -> None:
        if gap_s is None:
            self.ttft.observe(stats.first_token - stats.arrived)
        else:
            self.itl.observe(gap_s)

    def on_finished(self, request: GenerationRequest, stats: RequestStats, reason: str) -> None:
        self.generation_tokens.inc(stats.output_tokens)
        self.success[reason].inc()
        self.e2e.observe(stats.finished - stats.arrived)


class SimMetrics(EngineMetrics):
    """The simulator's /metrics: engine 0's series (this object) and those `engine` adds for the other data
    parallel ranks, every one labelled with its engine="R" as vLLM labels them."""

    def __init__(self, model_name: str, cache: PrefixCache, max_num_seqs: int) -> None:
        self.registry = CollectorRegistry()
        self._families = _Families(self.registry, cache)
        self._model_name = model_name
        super().__init__(self._families, model_name, 0, cache, max_num_seqs)

    def engine(self, rank: int, cache: PrefixCache, max_num_seqs: int) -> EngineMetrics:
        """Rank `rank`'s series (rank 0's is this object)."""
        return EngineMetrics(self._families, self._model_name, rank, cache, max_num_seqs)

    def count_published(self, publishers: Mapping[int, Publisher]) -> None:
        """The sim's own series, not vLLM's: `dpserve_sim_kv_event_batches_total`, the KV-event batches each
        engine has published (dropped ones included: the next batch's sequence number), so a subscriber can be
        waited on until it has seen every one."""
        self.registry.register(_PublishedBatches(self._model_name, publishers))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Publisher(Protocol):
    @property
    def published(self) -> int: ...


class _PublishedBatches(Collector):
    def __init__(self, model_name: str, publishers: Mapping[int, Publisher]) -> None:
        self._model_name = model_name
        self._publishers = publishers

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "dpserve_sim_kv_event_batches", "KV-event batches published.", labels=("model_name", "engine")
        )
        for rank, publisher in self._publishers.items():
            family.add_metric((self._model_name, str(rank)), publisher.published)
        yield family
