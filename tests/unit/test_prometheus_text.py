from __future__ import annotations

from dpserve.replicas.monitor import SCRAPED_METRICS
from dpserve.replicas.prometheus_text import parse_samples

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="dpserve-tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="dpserve-tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="dpserve-tiny"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="dpserve-tiny",reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="dpserve-tiny"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="dpserve-tiny"} 1024.0
vllm:prefix_cache_hits_total{engine="0",model_name="dpserve-tiny"} 512.0
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0"} 1.0
process_open_fds 12.0
weird{label="with \\"quote\\" and } brace",other="x"} 7
"""


def test_reads_vllm_samples_summed_over_engines() -> None:
    samples = parse_samples(VLLM_METRICS, SCRAPED_METRICS)
    assert samples.total("vllm:num_requests_running") == 5.0
    assert samples.total("vllm:num_requests_waiting") == 4.0  # not the _by_reason series
    assert samples.total("vllm:kv_cache_usage_perc") == 0.25
    assert samples.total("vllm:prefix_cache_hits_total") == 512.0
    labels = samples.first_labels("vllm:cache_config_info")
    assert labels is not None and labels["block_size"] == "128" and labels["engine"] == "0"


def test_skips_unwanted_and_absent_metrics() -> None:
    samples = parse_samples(VLLM_METRICS, {"process_open_fds", "missing"})
    assert samples.total("process_open_fds") == 12.0
    assert samples.total("missing") is None
    assert samples.total("vllm:num_requests_running") is None


def test_label_values_with_quotes_and_braces() -> None:
    samples = parse_samples(VLLM_METRICS, {"weird"})
    assert samples.first_labels("weird") == {"label": 'with "quote" and } brace', "other": "x"}
    assert samples.total("weird") == 7.0
