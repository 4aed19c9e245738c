"""The spec-decode counters read from a /metrics page written the way vLLM writes it: by `prometheus_client`, with
vLLM's metric names and labels, two engines, per-position counters and unrelated histograms on the same page."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from eagle3_train.serving.metrics import counter_total, parse_prometheus, spec_decode_counters

K = 3  # draft tokens per draft


def _server(registry: CollectorRegistry):
    labels = ["model_name", "engine"]
    return {
        "drafts": Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels,
                          registry=registry),
        "draft_tokens": Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels,
                                registry=registry),
        "accepted": Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels,
                            registry=registry),
        "per_pos": Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per position.",
                           labels + ["position"], registry=registry),
        "gen": Counter("vllm:generation_tokens", "Number of generation tokens.", labels, registry=registry),
        "ttft": Histogram("vllm:time_to_first_token_seconds", "TTFT.", labels, registry=registry),
    }


def _step(m, engine: str, accepted_prefix: int):
    """One verification step of one draft: the first `accepted_prefix` of K draft tokens are accepted."""
    lab = {"model_name": 'my "draft"\\model', "engine": engine}
    m["drafts"].labels(**lab).inc()
    m["draft_tokens"].labels(**lab).inc(K)
    m["accepted"].labels(**lab).inc(accepted_prefix)
    for pos in range(K):  # vLLM exposes every position, also those never accepted
        m["per_pos"].labels(**lab, position=str(pos)).inc(1 if pos < accepted_prefix else 0)
    m["gen"].labels(**lab).inc(accepted_prefix + 1)
    m["ttft"].labels(**lab).observe(0.05 * (1 + accepted_prefix))


def test_counters_from_a_page_written_by_prometheus_client():
    registry = CollectorRegistry()
    m = _server(registry)
    steps = [("0", 2), ("0", 0), ("1", 3), ("1", 1), ("0", 3)]
    for engine, a in steps[:2]:
        _step(m, engine, a)
    before = spec_decode_counters(parse_prometheus(generate_latest(registry).decode()))
    for engine, a in steps[2:]:
        _step(m, engine, a)
    text = generate_latest(registry).decode()
    samples = parse_prometheus(text)
    assert len(samples) == sum(1 for ln in text.splitlines() if ln and not ln.startswith("#"))
    assert samples[0].labels["model_name"] == 'my "draft"\\model'  # escapes undone

    c = spec_decode_counters(samples)
    assert c.present and "vllm:spec_decode_num_drafts_total" in c.metric_names
    assert c.num_drafts == len(steps) and c.num_draft_tokens == K * len(steps)
    assert c.num_accepted_tokens == sum(a for _, a in steps)
    assert c.accepted_per_pos == {p: sum(a > p for _, a in steps) for p in range(K)}
    assert c.generation_tokens == sum(a + 1 for _, a in steps) == counter_total(samples, "vllm:generation_tokens")
    s = c.summary()
    assert s["mean_acceptance_length"] == pytest.approx(1 + sum(a for _, a in steps) / len(steps))
    assert s["draft_acceptance_rate"] == pytest.approx(sum(a for _, a in steps) / (K * len(steps)))

    d = c.since(before)
    later = steps[2:]
    assert d.num_drafts == len(later) and d.num_accepted_tokens == sum(a for _, a in later)
    assert d.accepted_per_pos == {p: sum(a > p for _, a in later) for p in range(K)}
    assert d.generation_tokens == sum(a + 1 for _, a in later)


def test_page_without_spec_decoding_and_malformed_lines():
    registry = CollectorRegistry()
    Counter("vllm:generation_tokens", "Number of generation tokens.", registry=registry).inc(7)
    c = spec_decode_counters(parse_prometheus(generate_latest(registry).decode()))
    assert not c.present and c.generation_tokens == 7 and c.summary()["mean_acceptance_length"] is None
    with pytest.raises(ValueError, match="line 3: .*'vllm:x{engine=0} 1'"):
        parse_prometheus("# TYPE vllm:y counter\nvllm:y 1\nvllm:x{engine=0} 1\n")
