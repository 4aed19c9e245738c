"""Stage `prepare`: tokenize conversations with the verifier's chat template and an assistant-only loss mask.

Output (docs/ARCHITECTURE.md): `OUT/dataset` (a `datasets.DatasetDict` with splits `train`/`validation`, columns
`id`, `input_ids`, `loss_mask`, `length`, `n_supervised`) and `OUT/manifest.json` (source file and hash, tokenizer
and chat-template hash, verifier, settings, counts). The directory is written under a temporary name and renamed
when complete.

Python API: `prepare(source, verifier, out_dir, max_length=..., overflow=..., val_fraction=..., seed=..., limit=...,
chat_template=..., val_count=..., leading_assistant=..., reasoning=..., skip_bad_records=...) -> dict` (the manifest),
defaults from `PrepareSettings` (docs/CONFIG.md); `preview(prepared_dir, n=3, split="train", color=None) -> str`.
CLI: `eagle3-train prepare --data sharegpt --verifier NAME_OR_DIR --out DIR [--max-length N]
[--overflow truncate|drop] [--limit N] [--val-fraction F | --val-count N] [--seed S] [--preview N]
[--skip-bad-records]`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import typing
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from eagle3_train.assets.conversation_records import REGENERATED, normalize_turns
from eagle3_train.assets.conversations import load_conversations
from eagle3_train.assets.data_spec import DataSource, data_items, parse_spec
from eagle3_train.assets.families import text_config
from eagle3_train.assets.tokenizer import check_same_tokens, converted_from, load_tokenizer, tokenizer_digest
from eagle3_train.assets.verifier import Verifier, as_verifier
from eagle3_train.data.chat_mask import UNSUPERVISED, ChatMasker, ChatTemplateError, format_masked
from eagle3_train.data.generated_ids import GeneratedIdsCheck
from eagle3_train.data.reasoning import (
    REASONING_KEY,
    check_reasoning_mode,
    place_reasoning,
    resolve_mode,
    split_at_user_turns,
)
from eagle3_train.data.split import TRAIN, VALIDATION, assign_splits, check_split_settings
from eagle3_train.settings import Overflow, PrepareSettings
from eagle3_train.utils.io import Eagle3InputError, check_at_least, read_json, sha256_file, sha256_text, write_json
from eagle3_train.utils.outputs import atomic_dir, claim_output_dir, stage_manifest
from eagle3_train.utils.progress import progress
from eagle3_train.utils.provenance import environment, now_iso
from eagle3_train.utils.settings import add_settings_arguments, choices, settings_from_args

log = logging.getLogger(__name__)

OVERFLOW_CHOICES = typing.get_args(Overflow)
COLUMNS = ("id", "input_ids", "loss_mask", "length", "n_supervised")
_BATCH = 256
_EXAMPLES_PER_REASON = 5
_SHARD_BYTES = 256 << 20  # ~5 bytes per token (int32 id + int8 mask)


def verifier_vocab_size(verifier_dir: Path) -> int:
    """The verifier's output vocabulary size (config `vocab_size`, or that of its text config)."""
    config = read_json(verifier_dir / "config.json", "verifier config")
    size = config.get("vocab_size") or text_config(config).get("vocab_size")
    if not isinstance(size, int) or size <= 0:
        raise Eagle3InputError(f"{verifier_dir / 'config.json'} has no positive integer 'vocab_size'")
    return size


def _chat_template(arg: str | None) -> tuple[str | None, str]:
    """(template text or None for the tokenizer's own, where it came from)."""
    if arg is None:
        return None, "tokenizer"
    p = Path(arg).expanduser()
    if p.is_file():
        return p.read_text(), str(p)
    if "{{" in arg or "{%" in arg:
        return arg, "inline"
    raise Eagle3InputError(f"chat template file not found: {p} (expected a .jinja file or a template string)")


def check_prepare_settings(max_length: int, overflow: str, val_fraction: float, val_count: int | None,
                           leading_assistant: str, reasoning: str) -> None:
    """What prepare refuses of its settings before reading anything (`run --dry-run` asks it too)."""
    check_reasoning_mode(reasoning)
    check_at_least("max_length", max_length, 2)
    if overflow not in OVERFLOW_CHOICES:
        raise Eagle3InputError(f"overflow must be one of {OVERFLOW_CHOICES}, got {overflow!r}")
    check_split_settings(val_fraction, val_count)
    if leading_assistant not in choices(PrepareSettings, "leading_assistant"):
        raise Eagle3InputError(f"leading_assistant must be 'trim' or 'skip', got {leading_assistant!r}")


_D = PrepareSettings  # keyword defaults below are the settings dataclass's


def prepare(source: DataSource, verifier: str | Path | Verifier, out_dir: str | Path, max_length: int = _D.max_length,
            overflow: str = _D.overflow, val_fraction: float = _D.val_fraction, seed: int = _D.seed,
            limit: int | None = _D.limit, chat_template: str | None = _D.chat_template,
            val_count: int | None = _D.val_count, leading_assistant: str = _D.leading_assistant,
            reasoning: str = _D.reasoning, trust_remote_code: bool = _D.trust_remote_code,
            skip_bad_records: bool = _D.skip_bad_records, overwrite: bool = _D.overwrite,
            supervise_kept_turns: bool = _D.supervise_kept_turns) -> dict[str, Any]:
    """Tokenize a conversation source for training; returns the manifest written to `out_dir/manifest.json`.

    `trust_remote_code`: allow a tokenizer class shipped as code in the verifier's directory (recorded).
    `skip_bad_records`: skip (and count in the manifest) source records that are not valid JSON/UTF-8 or not
    conversations, instead of stopping at the first. `overwrite`: replace an earlier prepared output in `out_dir`
    made from other data, verifier or settings (without it that is refused; the same inputs are prepared again).
    Regenerated data (`generate`'s conversations.jsonl) is rendered with the `chat_template_kwargs` it was generated
    with; its kept turns are context unless `supervise_kept_turns`; its generated token ids are compared with the
    supervised ones (`counts.generated_ids`).
    """
    t0 = time.time()
    check_prepare_settings(max_length, overflow, val_fraction, val_count, leading_assistant, reasoning)
    _check_not_inside(source, Path(out_dir))
    out_dir = claim_output_dir(out_dir, "prepare", "prepared output directory", stage_manifest("prepare"),
                               replaces=True, create=False)
    template, template_source = _chat_template(chat_template)
    # bad paths fail before the tokenizer loads
    conversations, info = load_conversations(source, limit=limit, skip_bad_records=skip_bad_records)
    verifier = as_verifier(verifier, need="tokenizer")  # a hub id: no weights for tokenizing
    settings = {"max_length": max_length, "overflow": overflow, "val_fraction": val_fraction,
                "val_count": val_count, "seed": seed, "limit": limit, "leading_assistant": leading_assistant,
                "reasoning": reasoning, "skip_bad_records": skip_bad_records,
                "supervise_kept_turns": supervise_kept_turns}
    template_sha256 = sha256_text(template or "")  # the --chat-template override ("" when none)
    if not overwrite:
        _check_same_inputs(out_dir, info.sha256, verifier.identity(), template_sha256, settings)
    verifier_dir = verifier.path
    tokenizer = load_tokenizer(verifier_dir, trust_remote_code)
    template_kwargs = generated_template_kwargs(info.regeneration)
    try:
        masker = ChatMasker(tokenizer, template, template_kwargs)
    except ValueError as e:
        raise Eagle3InputError(f"verifier {verifier_dir}: {e}") from None
    renders_reasoning = masker.renders_reasoning()
    reasoning_mode = resolve_mode(reasoning, renders_reasoning)

    kept = _Tokenized(masker, max_length, overflow, verifier_dir, supervise_kept_turns)
    with progress(total=limit, desc="prepare", unit="conv") as bar:
        kept.add_all(conversations, info, bar, leading_assistant, reasoning_mode, renders_reasoning)
    if not kept.samples:
        raise Eagle3InputError(f"no usable conversations in {info.path}: read {kept.n_read}, skipped "
                               f"{dict(kept.skipped) or 'none'}")
    # conversations that share an id (renamed ID#N when read) go to one split: parts of one chat must not straddle it
    splits = assign_splits([s["id"] for s in kept.samples], val_fraction, seed, val_count,
                           group=[s["id"].split("#")[0] for s in kept.samples])
    by_split: dict[str, list[dict[str, Any]]] = {TRAIN: [], VALIDATION: []}
    for s, name in zip(kept.samples, splits):
        by_split[name].append(s)

    counts = kept.counts(by_split, info)
    manifest: dict[str, Any] = {
        "stage": "prepare",
        "created": now_iso(),
        "trust_remote_code": bool(trust_remote_code),
        "source": info.to_dict(),
        "verifier": {**verifier.identity(), "vocab_size": verifier_vocab_size(verifier_dir)},
        "tokenizer": _tokenizer_record(verifier_dir, tokenizer, masker.chat_template, template_source),
        "settings": {**settings, "reasoning_placed": reasoning_mode, "template_renders_reasoning": renders_reasoning,
                     "chat_template_kwargs": template_kwargs},
        "chat_template_override_sha256": template_sha256,
        "counts": counts,
        "skip_examples": kept.examples,
        "dataset": {"path": "dataset", "splits": [TRAIN, VALIDATION], "columns": list(COLUMNS)},
        "environment": environment(),
    }
    _write_prepared(out_dir, by_split, manifest, t0)
    log.info("prepared %d train + %d validation conversations (%d skipped, %d truncated) in %.1fs -> %s",
             counts["kept"][TRAIN], counts["kept"][VALIDATION], counts["skipped_total"], kept.truncated,
             manifest["elapsed_s"], out_dir)
    return manifest


class _Tokenized:
    """The conversations prepare keeps, as token ids and loss masks, and the counts of what it skipped and why."""

    def __init__(self, masker: ChatMasker, max_length: int, overflow: str, verifier_dir: Path,
                 supervise_kept_turns: bool = False) -> None:
        self.masker, self.max_length, self.overflow = masker, max_length, overflow
        # a tokenizer converted from the verifier's own (tiktoken) one: every conversation is checked against it
        self.original, self.verifier_dir = converted_from(masker.tokenizer), verifier_dir
        self.skipped: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}
        self.samples: list[dict[str, Any]] = []
        self.truncated = 0
        self.trimmed_leading = 0  # conversations whose leading assistant turns were dropped by normalize_turns
        self.reasoning_turns = 0
        self.n_read = 0
        # the template drops earlier turns' reasoning: split multi-turn conversations at their user turns
        self.split_turns = masker.drops_earlier_reasoning()
        self.split_conversations = 0
        self.supervise_kept_turns = supervise_kept_turns
        self.kept_turns_unsupervised = 0  # regenerated data: source turns kept as given, trained as context only
        self.with_tools = 0
        self.generated_ids = GeneratedIdsCheck()

    def skip(self, reason: str, conv_id: str) -> None:
        self.skipped[reason] += 1
        self.examples.setdefault(reason, [])
        if len(self.examples[reason]) < _EXAMPLES_PER_REASON:
            self.examples[reason].append(conv_id)

    def add_all(self, conversations, info, bar, leading_assistant: str, reasoning_mode: str,
                renders_reasoning: bool) -> None:
        """Normalize each conversation's turns, place its reasoning, and tokenize in batches of _BATCH."""
        batch: list[tuple[str, list[dict[str, str]], list[dict[str, Any]] | None]] = []
        for conv in conversations:
            self.n_read += 1
            bar.update(1)
            messages, reason = normalize_turns(conv.messages, leading_assistant)
            if reason:
                self.skip(reason, conv.id)
                continue
            lead = next((m["role"] for m in conv.messages if m["role"] != "system"), None)
            self.trimmed_leading += lead == "assistant"
            with_reasoning = sum(1 for m in messages if m.get(REASONING_KEY))
            if with_reasoning and reasoning_mode == "template" and not renders_reasoning:
                raise Eagle3InputError(f"{info.path}: conversation {conv.id} carries reasoning_content but the chat "
                                       f"template ignores it (it would be dropped silently); use --reasoning "
                                       f"inline, drop or auto")
            self.reasoning_turns += with_reasoning
            if not self.supervise_kept_turns:  # the verifier did not produce these: context, not targets
                kept_turns = sum(m.get(REGENERATED) is False for m in messages)
                self.kept_turns_unsupervised += kept_turns
                if kept_turns:
                    messages = [{**m, UNSUPERVISED: True} if m.get(REGENERATED) is False else m for m in messages]
            self.with_tools += bool(conv.tools)
            placed = place_reasoning(messages, reasoning_mode)
            parts = split_at_user_turns(placed) if self.split_turns and with_reasoning else [placed]
            self.split_conversations += len(parts) > 1
            batch += [(conv.id if len(parts) == 1 else f"{conv.id}#turn{j + 1}", part, conv.tools)
                      for j, part in enumerate(parts)]
            if len(batch) >= _BATCH:
                self.flush(batch)
                batch = []
        self.flush(batch)

    def flush(self, batch: list[tuple[str, list[dict[str, str]], list[dict[str, Any]] | None]]) -> None:
        max_length = self.max_length
        results = self.masker.encode_batch([m for _, m, _ in batch], max_length, [t for _, _, t in batch])
        for (conv_id, messages, _), res in zip(batch, results):
            if isinstance(res, ChatTemplateError):
                if not self.skipped["chat_template_error"]:
                    log.warning("conversation %s skipped: %s (later ones: see the manifest's skip counts)",
                                conv_id, res)
                self.skip("chat_template_error", conv_id)
                continue
            ids, mask = res.input_ids, res.loss_mask
            if self.original is not None:
                check_same_tokens(self.original, self.masker.tokenizer, [res.text], self.verifier_dir)
            cut = len(ids) > max_length
            if cut:
                if self.overflow == "drop":
                    self.skip("too_long", conv_id)
                    continue
                ids, mask = ids[:max_length], mask[:max_length]
            self.generated_ids.add(conv_id, messages, ids, mask, cut)
            n_sup = sum(mask)
            if n_sup == 0:
                self.skip("no_supervised_after_truncation" if cut else "no_supervised_tokens", conv_id)
                continue
            self.truncated += cut
            # numpy rows: a fraction of the memory of Python int lists for large sources
            self.samples.append({"id": conv_id, "input_ids": np.asarray(ids, dtype=np.int32),
                                 "loss_mask": np.asarray(mask, dtype=np.int8), "length": len(ids),
                                 "n_supervised": n_sup})

    def counts(self, by_split: dict[str, list[dict[str, Any]]], info) -> dict[str, Any]:
        return {
            "conversations_read": self.n_read,
            "kept": {k: len(v) for k, v in by_split.items()},
            "skipped": dict(sorted(self.skipped.items())),
            "skipped_total": sum(self.skipped.values()),
            "bad_records": dict(sorted(info.bad_records.items())),  # skipped source records (skip_bad_records)
            "duplicates_dropped": info.duplicates_dropped,  # conversations repeated word for word, kept once
            "truncated": self.truncated,
            "trimmed_leading_assistant": self.trimmed_leading,
            "assistant_turns_with_reasoning": self.reasoning_turns,
            # samples of a conversation split at its user turns share its id + "#turnN" (and its split)
            "split_at_user_turns": self.split_conversations,
            "kept_turns_unsupervised": self.kept_turns_unsupervised,
            "conversations_with_tools": self.with_tools,
            # regenerated turns: supervised ids vs the ids the verifier generated (None: no ids recorded)
            "generated_ids": self.generated_ids.record(),
            "tokens": {k: sum(s["length"] for s in v) for k, v in by_split.items()},
            "supervised_tokens": {k: sum(s["n_supervised"] for s in v) for k, v in by_split.items()},
            "max_length_seen": max(s["length"] for s in self.samples),
        }


def generated_template_kwargs(regeneration: dict[str, Any] | None) -> dict[str, Any]:
    """The `chat_template_kwargs` `generate` sent (its thinking switch, e.g. Kimi's `thinking: false`): rendered
    without them, a turn generated with thinking off gets the template's empty think block as supervised tokens."""
    extra = ((regeneration or {}).get("thinking") or {}).get("request_extra") or {}
    kwargs = extra.get("chat_template_kwargs") if isinstance(extra, dict) else None
    return dict(kwargs) if isinstance(kwargs, dict) else {}


def _check_not_inside(source: DataSource, out_dir: Path) -> None:
    """Preparing replaces `out_dir` as a whole: a source file inside it would be deleted with the old output."""
    for item in data_items(source):
        path = Path(parse_spec(item).source).expanduser()
        if path.exists() and path.resolve().is_relative_to(out_dir.resolve()):
            raise Eagle3InputError(f"--data {item} lies inside --out {out_dir}, which prepare replaces as a whole: "
                                   f"move the data out of it, or choose another --out")


def _check_same_inputs(out_dir: Path, source_sha256: str, verifier: dict[str, Any], template_sha256: str,
                       settings: dict[str, Any]) -> None:
    """Refuse to replace an earlier prepared output made from other inputs or settings (--overwrite does)."""
    if not (out_dir / "manifest.json").is_file():
        return
    old = read_json(out_dir / "manifest.json", "prepared-data manifest")
    diffs = [name for name, was, now in [
        ("data", (old.get("source") or {}).get("sha256"), source_sha256),
        ("verifier", (old.get("verifier") or {}).get("config_sha256"), verifier.get("config_sha256")),
        ("chat_template", old.get("chat_template_override_sha256", template_sha256), template_sha256),
        *((k, (old.get("settings") or {}).get(k), v) for k, v in settings.items()),
    ] if was != now]
    if diffs:
        raise Eagle3InputError(f"{out_dir} already holds data prepared with other {', '.join(diffs)}; pass "
                               f"--overwrite to replace it, or choose another --out")


def _tokenizer_record(verifier_dir: Path, tokenizer, chat_template: str, template_source: str) -> dict[str, Any]:
    digest = tokenizer_digest(verifier_dir)
    original = converted_from(tokenizer)
    return {
        "path": str(verifier_dir),
        "class": type(tokenizer).__name__,
        # the verifier's own class when it ships a slow tiktoken tokenizer (converted, checked on every conversation)
        "converted_from": type(original).__name__ if original is not None else None,
        "size": len(tokenizer),
        "vocab_file": digest[0] if digest else None,
        "vocab_file_sha256": digest[1] if digest else None,
        "chat_template_sha256": sha256_text(chat_template),
        "chat_template_source": template_source,
    }


def _write_prepared(out_dir: Path, by_split: dict[str, list[dict[str, Any]]], manifest: dict[str, Any],
                    t0: float) -> None:
    # replaces an earlier prepared output only when complete
    with atomic_dir(out_dir, "prepare", "prepared output directory", stage_manifest("prepare")) as tmp:
        # Explicit shard counts: datasets cannot load back an empty split saved with its default of 0 shards.
        shards = {k: max(1, -(-sum(s["length"] for s in v) * 5 // _SHARD_BYTES)) for k, v in by_split.items()}
        _to_dataset_dict(by_split).save_to_disk(str(tmp / "dataset"), num_shards=shards)
        manifest["elapsed_s"] = round(time.time() - t0, 3)
        write_json(tmp / "manifest.json", manifest)


def _to_dataset_dict(by_split: dict[str, list[dict[str, Any]]]):
    import datasets
    import pyarrow as pa

    features = datasets.Features({
        "id": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "length": datasets.Value("int32"),
        "n_supervised": datasets.Value("int32"),
    })
    def column(name: str, rows: list[dict[str, Any]]):
        if name in ("input_ids", "loss_mask"):  # build the Arrow list column directly: from_dict on numpy is slow
            dtype = np.int32 if name == "input_ids" else np.int8
            offsets = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum([len(r[name]) for r in rows], out=offsets[1:])
            values = np.concatenate([r[name] for r in rows]) if rows else np.zeros(0, dtype=dtype)
            return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values.astype(dtype, copy=False)))
        return [r[name] for r in rows]

    return datasets.DatasetDict({
        name: datasets.Dataset.from_dict({c: column(c, rows) for c in COLUMNS}, features=features)
        for name, rows in by_split.items()
    })


def load_prepared(prepared_dir: str | Path, splits: Sequence[str] = (TRAIN, VALIDATION),
                  columns: Sequence[str] = COLUMNS) -> tuple[Any, dict[str, Any]]:
    """(DatasetDict, manifest) of a prepared directory, with clear errors when it is not one or lacks one of `splits`
    or one of `columns` in them (the one reader of prepared data: extract asks for fewer columns and its splits)."""
    import datasets

    prepared_dir = Path(prepared_dir)
    if not prepared_dir.is_dir():
        raise Eagle3InputError(f"prepared directory not found: {prepared_dir} (prepared-data manifest not found): run "
                               f"`eagle3-train prepare` first")
    if not (prepared_dir / "manifest.json").is_file():
        raise Eagle3InputError(f"{prepared_dir} has no manifest.json (prepared-data manifest not found): not the "
                               f"output of `eagle3-train prepare`")
    manifest = read_json(prepared_dir / "manifest.json", "prepared-data manifest")
    if manifest.get("stage") != "prepare":
        raise Eagle3InputError(f"{prepared_dir / 'manifest.json'} is not a `prepare` manifest "
                               f"(stage={manifest.get('stage')!r})")
    ds_dir = prepared_dir / "dataset"
    if not ds_dir.is_dir():
        raise Eagle3InputError(f"{ds_dir} not found (expected the prepared DatasetDict)")
    try:
        dd = datasets.load_from_disk(str(ds_dir))
        for table in [dd[s].data for s in dd] if isinstance(dd, datasets.DatasetDict) else []:
            # a cut-off arrow file fails here, on reading its table, not at first use
            table.validate(full=False)
            if "length" in table.column_names:
                len(table.column("length"))
    except Exception as e:  # noqa: BLE001 - datasets and pyarrow raise many types for a damaged file
        raise Eagle3InputError(f"cannot read the prepared data in {ds_dir} ({type(e).__name__}: "
                               f"{str(e).strip()[:200]}); it is damaged: run `eagle3-train prepare` again") from None
    if not isinstance(dd, datasets.DatasetDict):
        raise Eagle3InputError(f"{ds_dir} holds a single Dataset; expected a DatasetDict with splits "
                               f"{', '.join(splits)}")
    for split in splits:
        if split not in dd:
            raise Eagle3InputError(f"split '{split}' not found in {ds_dir} (it has: {', '.join(dd)})")
        missing = [c for c in columns if c not in dd[split].column_names]
        if missing:
            raise Eagle3InputError(f"split '{split}' of {ds_dir} lacks column(s) {', '.join(missing)} "
                                   f"(has {', '.join(dd[split].column_names)})")
    return dd, manifest


def check_prepared_tokenizer(prepared_dir: Path, verifier_path: Path) -> None:
    """The prepared-data contract: refuse data tokenized with another tokenizer than the verifier's (its token ids
    mean other text)."""
    manifest = read_json(prepared_dir / "manifest.json", "prepared-data manifest")
    tok = manifest.get("tokenizer") or {}
    name, recorded = tok.get("vocab_file"), tok.get("vocab_file_sha256")
    if not recorded and tok.get("tokenizer_json_sha256"):  # prepared before vocab_file was recorded
        name, recorded = "tokenizer.json", tok["tokenizer_json_sha256"]
    if not recorded or not (verifier_path / name).is_file():
        return
    now = sha256_file(verifier_path / name)
    if now != recorded:
        raise Eagle3InputError(f"prepared data {prepared_dir} was tokenized with another tokenizer ({tok.get('path')}, "
                               f"{name} sha256 {recorded[:12]}) than verifier {verifier_path} "
                               f"({now[:12]}): prepare the data with this verifier, or extract with the one it was "
                               f"prepared for")


def preview(prepared_dir: str | Path, n: int = 3, split: str = TRAIN, color: bool | None = None) -> str:
    """N samples decoded with the supervised tokens highlighted (ANSI green on a terminal, else «...»)."""
    dd, manifest = load_prepared(prepared_dir)
    tokenizer = load_tokenizer(manifest["tokenizer"]["path"], manifest.get("trust_remote_code", False))
    if color is None:
        color = sys.stdout.isatty()
    ds = dd[split]
    out = []
    for row in ds.select(range(min(n, len(ds)))):
        head = f"=== {split} sample {row['id']}: {row['length']} tokens, {row['n_supervised']} supervised ==="
        out.append(head + "\n" + format_masked(tokenizer, row["input_ids"], row["loss_mask"], color=color))
    return "\n\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p, PrepareSettings)


def main(args: argparse.Namespace) -> int:
    s = settings_from_args(PrepareSettings, args)
    manifest = prepare(s.data, s.verifier, s.out, max_length=s.max_length, overflow=s.overflow,
                       val_fraction=s.val_fraction, seed=s.seed, limit=s.limit, chat_template=s.chat_template,
                       val_count=s.val_count, leading_assistant=s.leading_assistant,
                       reasoning=s.reasoning, trust_remote_code=s.trust_remote_code,
                       skip_bad_records=s.skip_bad_records, overwrite=s.overwrite,
                       supervise_kept_turns=s.supervise_kept_turns)
    c = manifest["counts"]
    src = manifest["source"]
    print(f"read {c['conversations_read']} conversations from {src['path']}"
          + (f" (skipped a cut-off tail at byte {src['broken_tail']['byte_offset']})" if src["broken_tail"] else ""))
    print(f"kept: train {c['kept']['train']}, validation {c['kept']['validation']}; "
          f"truncated {c['truncated']}; skipped {c['skipped_total']} {json.dumps(c['skipped'])}"
          + (f"; {c['duplicates_dropped']} repeated conversations kept once" if c["duplicates_dropped"] else ""))
    if c["bad_records"]:
        print(f"bad source records skipped: {json.dumps(c['bad_records'])}; first: "
              + ", ".join(f"line {e['line']} ({e['reason']})" for e in src["bad_record_examples"]))
    print(f"tokens: {json.dumps(c['tokens'])}; supervised: {json.dumps(c['supervised_tokens'])}")
    print(f"took {manifest['elapsed_s']:.1f}s -> {s.out}")
    if s.preview:
        print()
        print(preview(s.out, s.preview))
    return 0
