"""--metrics-name-style and the --bucket-* flags: the names SGLang's and vLLM's dashboards query."""
import pytest

from xlaserve.http.observability import NAME_STYLES, Metrics

STATS = {"num_running_reqs": 3, "num_queue_reqs": 2, "token_usage": 0.25}
EXPECTED = {  # a sample line of each family, as each server writes it
    "xlaserve": ['xlaserve:num_running_reqs{model_name="m"} 3.0',
                 'xlaserve:token_usage{model_name="m"} 0.25',
                 'xlaserve:num_requests_total{finish_reason="stop",model_name="m"} 1.0',
                 'xlaserve:generation_tokens_total{model_name="m"} 7.0'],
    "sglang": ['sglang:num_running_reqs{model_name="m"} 3.0',
               'sglang:num_queue_reqs{model_name="m"} 2.0',
               'sglang:prompt_tokens_total{model_name="m"} 5.0',
               'sglang:e2e_request_latency_seconds_count{model_name="m"} 1.0'],
    "vllm": ['vllm:num_requests_running{model_name="m"} 3.0',
             'vllm:num_requests_waiting{model_name="m"} 2.0',
             'vllm:kv_cache_usage_perc{model_name="m"} 0.25',
             'vllm:request_success_total{finished_reason="stop",model_name="m"} 1.0',
             'vllm:time_to_first_token_seconds_count{model_name="m"} 1.0'],
}


@pytest.mark.parametrize("style", NAME_STYLES)
def test_each_name_style_writes_that_servers_names_and_no_other(style):
    metrics = Metrics("m", lambda: STATS, style)
    metrics.request_started(5)
    metrics.time_to_first_token.observe(0.05)
    metrics.request_finished("stop", 7, 0.5)
    text = metrics.render().decode()
    lines = text.splitlines()
    for line in EXPECTED[style]:
        assert line in lines
    others = {s + ":" for s in NAME_STYLES} - {style + ":"}
    assert not any(line.split("{")[0].split(" ")[-1].startswith(tuple(others)) for line in lines
                   if not line.startswith("#"))


def test_histogram_buckets_come_from_the_flags():
    metrics = Metrics("m", lambda: STATS, "sglang", ttft_buckets=[0.1, 1.0, 10.0])
    metrics.time_to_first_token.observe(0.5)
    lines = metrics.render().decode().splitlines()
    ttft = [line for line in lines if line.startswith("sglang:time_to_first_token_seconds_bucket")]
    assert ttft == ['sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 0.0',
                    'sglang:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 1.0',
                    'sglang:time_to_first_token_seconds_bucket{le="10.0",model_name="m"} 1.0',
                    'sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 1.0']
    itl = [line for line in lines if line.startswith("sglang:inter_token_latency_seconds_bucket")]
    assert len(itl) == 20  # the default 19 and +Inf
