"""The output directory and resuming in it: its files, claiming it for generate, and what an earlier run there
finished (refused when it ran under other settings or on other data)."""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_train.assets.data_spec import DataSource
from eagle3_train.generate.journal import recover_jsonl
from eagle3_train.generate.run_settings import Sampling
from eagle3_train.utils.io import Eagle3InputError, read_json
from eagle3_train.utils.outputs import claim_output_dir, stage_manifest

SERVER_LOG = "vllm.log"  # the log of a server this stage starts, kept beside its output

OUTPUT_FILE = "conversations.jsonl"
SKIPPED_FILE = "skipped.jsonl"
MANIFEST_FILE = "manifest.json"


class Files(typing.NamedTuple):
    conversations: Path
    skipped: Path
    manifest: Path


OUTPUT = ("generate", "generate output directory")


def _written_by_generate(path: Path) -> bool:
    """From before output markers: an earlier generate output, or only the log of the server started for it."""
    return stage_manifest("generate")(path) or {f.name for f in path.iterdir()} <= {SERVER_LOG}


def claim_generate_output(out_dir: str | Path) -> Path:
    """Claim `out_dir` for generate; called before a server started for it writes its log there."""
    return claim_output_dir(out_dir, *OUTPUT, _written_by_generate,
                            writes=(OUTPUT_FILE, SKIPPED_FILE, MANIFEST_FILE, SERVER_LOG))


def output_files(out_dir: Path) -> Files:
    return Files(out_dir / OUTPUT_FILE, out_dir / SKIPPED_FILE, out_dir / MANIFEST_FILE)


@dataclass
class Resume:
    total: int  # conversations in the source (after `limit`)
    source_sha: str
    seen: set[str]  # ids already done or skipped by earlier runs
    torn_bytes: int  # removed from torn last lines


def resume_point(files: Files, source: DataSource, limit: int | None, skip_bad_records: bool, overwrite: bool,
                 model: str, sampling: Sampling) -> Resume:
    """Start over (`overwrite`) or check that the earlier run had the same settings, and read what it finished."""
    total, source_sha = _count_source(source, limit, skip_bad_records)
    if overwrite:
        for p in files:
            p.unlink(missing_ok=True)
    _check_resume(files.manifest, model, sampling, source_sha)
    done_records, cut = recover_jsonl(files.conversations, ids_only=True)
    skipped_records, cut2 = recover_jsonl(files.skipped, "skipped", ids_only=True)
    seen = {r["id"] for r in done_records} | {r["id"] for r in skipped_records}
    return Resume(total, source_sha, seen, cut + cut2)


def _check_resume(manifest_path: Path, model: str, sampling: Sampling, source_sha: str) -> None:
    if not manifest_path.exists():
        return
    old = read_json(manifest_path, "generate manifest")
    old_sampling = old.get("sampling", {})
    problems = []
    if old.get("model") != model:
        problems.append(f"model {old.get('model')!r} -> {model!r}")
    for k, v in asdict(sampling).items():
        if k in old_sampling and old_sampling[k] != v:
            problems.append(f"{k} {old_sampling[k]!r} -> {v!r}")
    if old.get("source", {}).get("sha256") not in (None, source_sha):
        problems.append("the source data changed (different SHA-256)")
    if problems:
        raise Eagle3InputError(f"{manifest_path.parent} holds a run with other settings ({'; '.join(problems)}); "
                               f"use another --out, the same settings to resume, or --overwrite to start over")


def _count_source(source: DataSource, limit: int | None, skip_bad_records: bool) -> tuple[int, str]:
    from eagle3_train.assets.conversations import load_conversations

    it, info = load_conversations(source, limit, skip_bad_records=skip_bad_records)
    n = sum(1 for _ in it)
    return n, info.sha256
