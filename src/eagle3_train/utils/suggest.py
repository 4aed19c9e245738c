"""Names users bring from other trainers, and the valid name a mistyped one most likely meant.

`ECOSYSTEM_ALIASES`: what speculators, SpecForge and Hugging Face's Trainer call our settings. As flags they are
accepted (`--learning-rate 1e-4` is `--lr 1e-4`: utils/stage_parser.py); as YAML or `--set` keys they are refused
with the key to write instead, so that a run config, its manifests and its settings hashes use one name for one thing.
`ECOSYSTEM_HINTS`: names whose nearest setting means something else (a batch of samples against our budget of
tokens): never accepted, only suggested with the difference.

`closest(name, valid)`: an ecosystem name of a valid one first, then the nearest by edit distance (two swapped
letters count as one edit) among the valid names and the ecosystem names of them, then a name it begins or ends.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import NamedTuple

# ecosystem name (underscore form) -> our setting(s): the first one a stage has is meant
ECOSYSTEM_ALIASES: dict[str, tuple[str, ...]] = {
    # optimisation
    "learning_rate": ("lr",),
    "num_epochs": ("epochs",),
    "num_train_epochs": ("epochs",),
    "max_num_steps": ("max_steps",),
    "total_steps": ("max_steps",),
    "gradient_accumulation_steps": ("grad_accum",),
    "draft_accumulation_steps": ("grad_accum",),
    "accumulation_steps": ("grad_accum",),
    "max_grad_norm": ("grad_clip",),
    "adam_beta1": ("beta1",),
    "adam_beta2": ("beta2",),
    "ttt_length": ("ttt_steps",),
    "ttt_step_loss_decay": ("step_decay",),
    "num_hidden_layers": ("num_layers",),
    # bookkeeping
    "logging_steps": ("log_every",),
    "log_steps": ("log_every",),
    "log_interval": ("log_every",),
    "eval_steps": ("eval_every",),
    "eval_interval": ("eval_every",),
    "save_steps": ("save_every",),
    "save_interval": ("save_every",),
    "save_total_limit": ("keep_last",),
    # paths and inputs
    "output_dir": ("out", "run_dir"),
    "output": ("out", "run_dir"),
    "output_path": ("out", "run_dir"),
    "save_path": ("out", "run_dir"),
    "save_dir": ("out", "run_dir"),
    "model_name_or_path": ("verifier",),
    "target_model_path": ("verifier",),
    "target_model": ("verifier",),
    "verifier_name_or_path": ("verifier",),
    "train_data_path": ("data",),
    "data_path": ("data",),
    "dataset": ("data",),
    # lengths and sizes
    "max_seq_length": ("max_length",),
    "max_seq_len": ("max_length",),
    "max_len": ("max_length",),
    "seq_length": ("max_length",),
    "total_seq_len": ("max_length",),
    "draft_vocab_size": ("size", "draft_vocab"),
}

_TOKENS_NOT_SAMPLES = "padded tokens per micro-batch, not a number of samples"
# ecosystem name -> (our nearest setting, how it differs)
ECOSYSTEM_HINTS: dict[str, tuple[str, str]] = {
    "batch_size": ("token_budget", _TOKENS_NOT_SAMPLES),
    "per_device_train_batch_size": ("token_budget", _TOKENS_NOT_SAMPLES),
    "train_batch_size": ("token_budget", _TOKENS_NOT_SAMPLES),
    "micro_batch_size": ("token_budget", _TOKENS_NOT_SAMPLES),
}
ECOSYSTEM = "speculators, SpecForge or HF Trainer"


class Suggestion(NamedTuple):
    name: str  # what to write instead, as the caller spells it (a key, or a flag)
    note: str = ""  # why, when it is not a plain near-miss


def spelling(name: str) -> str:
    """The form names are compared in: no leading dashes, underscores for dashes, lower case."""
    return name.lstrip("-").replace("-", "_").lower()


def edit_distance(a: str, b: str) -> int:
    """Edits (insert, delete, replace, swap of two neighbours) that turn `a` into `b`."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def ecosystem_target(name: str, valid: Iterable[str]) -> str | None:
    """Our setting that the ecosystem's `name` means, where it is one of `valid` (setting names)."""
    valid = set(valid)
    return next((t for t in ECOSYSTEM_ALIASES.get(spelling(name), ()) if t in valid), None)


def closest(name: str, valid: Mapping[str, str] | Iterable[str]) -> Suggestion | None:
    """The valid name `name` most likely meant, or None. `valid`: names, or {name: what to suggest for it} (a flag
    for a setting name, so that an ecosystem name finds the flag of the setting it means)."""
    answers = dict(valid) if isinstance(valid, Mapping) else {v: v for v in valid}
    by_spelling = {spelling(k): a for k, a in answers.items()}
    key = spelling(name)
    if key in by_spelling:
        return Suggestion(by_spelling[key])
    target = ecosystem_target(key, by_spelling)
    if target is not None:
        return Suggestion(by_spelling[target], f"'{name}' is the {ECOSYSTEM} name")
    if key in ECOSYSTEM_HINTS and ECOSYSTEM_HINTS[key][0] in by_spelling:
        hint, why = ECOSYSTEM_HINTS[key]
        return Suggestion(by_spelling[hint], why)
    # near-misses of our names and of the ecosystem's names for them, scored by edits; ties: ours, then the likelier
    theirs = {alias: ecosystem_target(alias, by_spelling) for alias in ECOSYSTEM_ALIASES}
    theirs |= {alias: hint if hint in by_spelling else None for alias, (hint, _) in ECOSYSTEM_HINTS.items()}
    candidates = [(_score(key, s), 0, -difflib.SequenceMatcher(None, key, s).ratio(), s, answer)
                  for s, answer in by_spelling.items()]
    candidates += [(_score(key, alias), 1, -difflib.SequenceMatcher(None, key, alias).ratio(), alias, by_spelling[t])
                   for alias, t in theirs.items() if t is not None]
    best = min(candidates, default=None)
    # within a third of the name's length (at least one slip), and never a name replaced whole (`-v` is not `-k`)
    if best is not None and best[0] <= max(1.5, len(key) / 3) and best[0] < max(len(key), len(best[3])):
        note = ECOSYSTEM_HINTS[best[3]][1] if best[3] in ECOSYSTEM_HINTS else ""
        return Suggestion(best[4], note)
    close = difflib.get_close_matches(key, list(by_spelling), n=1, cutoff=0.75)
    return Suggestion(by_spelling[close[0]]) if close else None


def _score(typed: str, name: str) -> float:
    """Edits between the two; a name the typed one begins or ends (`--warmup` for warmup_ratio, `--dir` for
    hidden_states_dir) counts as one and a half, after every single slip."""
    d = float(edit_distance(typed, name))
    short, long_ = sorted((typed, name), key=len)
    if len(short) >= 3 and (long_.startswith(short) or long_.endswith("_" + short)):
        d = min(d, 1.5)
    return d
