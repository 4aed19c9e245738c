"""The run's manifest at any point (counts read back from the output files, this run's rates) and the measured ETA
of the rest after the first wave of conversations."""

from __future__ import annotations

import json
import logging
import time
import typing
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_train.generate.conversation import Stats
from eagle3_train.generate.resume import OUTPUT_FILE, SKIPPED_FILE, Files, Resume
from eagle3_train.serving.client import ChatPool
from eagle3_train.utils.provenance import environment, now_iso

if typing.TYPE_CHECKING:
    from eagle3_train.assets.conversation_files import SourceInfo

log = logging.getLogger(__name__)


@dataclass
class Report:
    """What the manifest says at any point of the run (`info` and `stats` fill in as conversations are read)."""
    files: Files
    pool: ChatPool
    settings: dict[str, Any]  # model, endpoints, sampling, ... in manifest order
    info: SourceInfo  # bad records are counted while the conversations are read
    resume: Resume
    extra: dict[str, Any]
    stats: Stats = field(default_factory=Stats)
    started: str = field(default_factory=now_iso)
    t0: float = field(default_factory=time.monotonic)
    eta: dict[str, Any] | None = None  # measured after the first wave of conversations

    def remaining(self) -> int:
        """Conversations of the source not yet done or skipped (by earlier runs or this one)."""
        return max(0, self.resume.total - len(self.resume.seen) - self.stats.handled)

    def estimate(self) -> None:
        """The ETA of the rest of the run from the rate since the start (logged once), taken when the first wave of
        conversations (one per request in flight) is done. It runs long: the first wave also warms the server, and
        its slowest conversation sets its time (benchmarks/generate_eta.py: the rest took 0.70x the ETA; measured
        after two waves the ETA came out 28% short instead, the second wave's slow conversations still in flight)."""
        now = time.monotonic()
        wall = now - self.t0
        finished = self.stats.handled
        rate = finished / wall if wall > 0 else 0.0
        left = self.remaining()
        self.eta = {"measured_conversations": finished, "measured_s": round(wall, 1),
                    "conversations_per_s": round(rate, 4),
                    "completion_tokens_per_s": round(self.stats.completion_tokens / wall, 1) if wall > 0 else None,
                    "remaining_conversations": left, "estimated_remaining_s": round(left / rate, 1) if rate else None,
                    "estimated_total_s": round(wall + left / rate, 1) if rate else None}
        log.info("generate: first %d conversations in %.1f s (%.1f completion tokens/s): ETA %s for the %d left",
                 finished, wall, self.eta["completion_tokens_per_s"] or 0, _hours(self.eta["estimated_remaining_s"]),
                 left)

    def manifest(self, status: str) -> dict:
        done, skipped = _file_counts(self.files.conversations, self.files.skipped)
        wall = time.monotonic() - self.t0
        stats, total = self.stats, self.resume.total
        return {
            "stage": "generate", "status": status, **self.settings,
            "source": {**self.info.to_dict(), "sha256": self.resume.source_sha},
            "counts": {"source_conversations": total, "done": done["done"], "truncated": done["truncated"],
                       "cut_at_max_tokens_kept": done["cut_at_max_tokens"],
                       "skipped": skipped, "bad_records": dict(sorted(self.info.bad_records.items())),
                       "remaining": max(0, total - done["done"] - sum(skipped.values()))},
            "files": {"conversations": OUTPUT_FILE, "skipped": SKIPPED_FILE},
            "eta": self.eta,
            "this_run": {"started": self.started, "wall_s": round(wall, 2), "requests": stats.requests,
                         "prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
                         "reasoning_tokens_est": round(stats.reasoning_tokens),
                         "answer_tokens_est": round(stats.answer_tokens), "cut_turns": stats.cut_turns,
                         "tool_call_turns_kept": stats.tool_call_turns_kept,
                         "requests_per_s": round(stats.requests / wall, 3) if wall > 0 else None,
                         "completion_tokens_per_s": round(stats.completion_tokens / wall, 2) if wall > 0 else None,
                         "retries": self.pool.retries, "torn_bytes_removed": self.resume.torn_bytes},
            "updated": now_iso(), "environment": environment(), **self.extra,
        }


def _hours(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def _file_counts(out_path: Path, skip_path: Path) -> tuple[dict[str, int], dict[str, int]]:
    done, truncated, cut = 0, 0, 0
    if out_path.exists():
        with open(out_path, "rb") as f:
            for line in f:
                if line.strip():
                    done += 1
                    truncated += b'"truncated"' in line
                    cut += b'"truncated": "max_tokens"' in line
    skipped: Counter[str] = Counter()
    if skip_path.exists():
        for line in skip_path.read_bytes().splitlines():  # small: one short line per skipped conversation
            try:
                skipped[json.loads(line)["reason"]] += 1
            except (json.JSONDecodeError, KeyError):
                continue
    return {"done": done, "truncated": truncated, "cut_at_max_tokens": cut}, dict(sorted(skipped.items()))
