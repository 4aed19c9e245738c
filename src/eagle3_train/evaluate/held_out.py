"""Whether evaluation prompts were held out from training: their user turns matched against the prepared data's, so
an acceptance measured on prompts the draft was trained on is flagged.

Python API: `held_out_check(prompts, prepared_dir, tokenizer) -> dict`, `held_out(prompts, prepared, tokenizer)` (the
check, or a record of why it was skipped), `validation_prompts(prepared_dir, tokenizer, limit)` (first turns of the
validation split), `user_turns_of(text, header, end)`, `normalize_text(text)`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eagle3_train.data.chat_mask import find_all, user_turn_delimiters
from eagle3_train.evaluate.prompts import EvalPrompt
from eagle3_train.utils.io import Eagle3InputError
from eagle3_train.utils.progress import progress

log = logging.getLogger(__name__)


def normalize_text(text: str) -> str:
    return " ".join(text.split())


def user_turns_of(text: str, header: str, end: str) -> list[str]:
    """Normalized contents of the user turns in a rendered (decoded) conversation; cut-off turns are skipped."""
    out = []
    for i in find_all(text, header):
        a = i + len(header)
        b = text.find(end, a) if end else -1
        if b >= 0:
            out.append(normalize_text(text[a:b]))
    return out


def _delimiters(manifest: dict[str, Any], tokenizer, notes: list[str]) -> tuple[str, str]:
    """The user-turn delimiters of the chat template the prepared data was rendered with (a note when that
    template is not available here and the tokenizer's is used instead)."""
    template = None
    source = (manifest.get("tokenizer") or {}).get("chat_template_source", "tokenizer")
    if source not in ("tokenizer", None):
        if Path(source).is_file():
            template = Path(source).read_text()
        else:
            notes.append(f"prepared with chat template {source!r}, not available here: used the tokenizer's")
    return user_turn_delimiters(tokenizer, template)


def validation_prompts(prepared_dir: str | Path, tokenizer, limit: int) -> list[EvalPrompt]:
    """The first user turn of the first `limit` conversations of the prepared validation split: prompts the draft
    was not trained on, from the training data's own distribution (for choosing among checkpoints, where a benchmark
    would be chosen on)."""
    from eagle3_train.data.prepare import load_prepared

    dd, manifest = load_prepared(Path(prepared_dir))
    if "validation" not in dd or len(dd["validation"]) == 0:
        raise Eagle3InputError(f"{prepared_dir} has no validation split to choose checkpoints on (prepare with "
                               f"val_fraction > 0)")
    header, end = _delimiters(manifest, tokenizer, [])
    ds = dd["validation"]
    prompts: list[EvalPrompt] = []
    for start in range(0, len(ds), 256):
        rows = ds[start:start + 256]
        for conv_id, text in zip(rows["id"], tokenizer.batch_decode(rows["input_ids"], skip_special_tokens=False)):
            turns = user_turns_of(text, header, end)
            if turns and turns[0]:
                prompts.append(EvalPrompt(id=str(conv_id), benchmark="validation", turns=[turns[0]]))
            if len(prompts) == limit:
                return prompts
    if not prompts:
        raise Eagle3InputError(f"{prepared_dir}: no user turn found in the validation split")
    return prompts


def held_out_check(prompts: list[EvalPrompt], prepared_dir: str | Path, tokenizer) -> dict[str, Any]:
    """Exact (whitespace-normalized) match of each prompt's user turns against the user turns of the prepared
    training data; `held_out` is True when no prompt turn occurs in the train split."""
    from eagle3_train.data.prepare import load_prepared

    prepared_dir = Path(prepared_dir)
    dd, manifest = load_prepared(prepared_dir)
    notes: list[str] = []
    header, end = _delimiters(manifest, tokenizer, notes)
    wanted: dict[str, list[tuple[str, int]]] = {}
    for p in prompts:
        for t, turn in enumerate(p.turns):
            wanted.setdefault(normalize_text(turn), []).append((p.id, t))
    overlaps: dict[str, list[dict[str, Any]]] = {}
    user_turns: dict[str, int] = {}
    for split in dd:
        ds = dd[split]
        found, n = [], 0
        bar = progress(total=len(ds), desc=f"held-out check ({split})", unit="conv")
        for start in range(0, len(ds), 512):
            rows = ds[start:start + 512]
            texts = tokenizer.batch_decode(rows["input_ids"], skip_special_tokens=False)
            for conv_id, text in zip(rows["id"], texts):
                for turn in user_turns_of(text, header, end):
                    n += 1
                    for pid, t in wanted.get(turn, []):
                        found.append({"prompt": pid, "turn": t + 1, "conversation": conv_id})
            bar.update(len(texts))
        bar.close()
        overlaps[split], user_turns[split] = found, n
    train = overlaps.get("train", [])
    return {
        "checked": True,
        "prepared": str(prepared_dir),
        "held_out": not train,
        "method": "exact match of whitespace-normalized user turns (decoded prepared input_ids)",
        "user_turn_delimiters": [header, end],
        "user_turns_scanned": user_turns,
        "prompts_in_train": sorted({o["prompt"] for o in train}),
        "first_turns_in_train": sorted({o["prompt"] for o in train if o["turn"] == 1}),
        "overlaps": overlaps,
        "notes": notes,
    }


def held_out(prompts: list[EvalPrompt], prepared: str | Path | None, tokenizer) -> dict[str, Any]:
    """The held-out check against `prepared` when it exists, else a record of why it was skipped."""
    if prepared and Path(prepared).is_dir():
        held = held_out_check(prompts, prepared, tokenizer)
    else:
        reason = (f"prepared data {prepared} not found" if prepared else
                  "no prepared data given (--prepared) or recorded in the draft's training metadata")
        held = {"checked": False, "held_out": None, "reason": reason}
        log.warning("held-out check skipped: %s", reason)
    if held.get("checked") and not held["held_out"]:
        log.warning("%d evaluation prompt(s) occur in the training data: %s", len(held["prompts_in_train"]),
                    held["prompts_in_train"][:10])
    return held
