"""Offline evaluation: greedy chain speculative decoding with the HF verifier and our draft, batch size 1.

Each round (as vLLM runs EAGLE-3 with a chain of k tokens):
1. Draft step 0 over every position p whose verifier features are new: fuse(aux_p) with the embedding of token p+1
   at RoPE position p (ids shifted left by one; the last one is the token the verifier just produced). Steps 1..k-1
   feed the previous draft hidden state and the draft's own token (mapped to verifier ids) at position +1.
2. The verifier reads [last token, d_1..d_k] in one forward with its KV cache; the longest prefix of drafts equal to
   its argmax is accepted and its next argmax (the bonus token) is emitted too.
3. Both caches are cropped: the verifier's to the accepted tokens, the draft's to the positions it computed from
   verifier features (the others are recomputed from verifier features next round, as vLLM does).
The output must equal plain greedy decoding token for token; `check_greedy` runs that decoding and compares.

Python API: `evaluate_offline(draft, verifier, prompts, k=..., max_new_tokens=..., ...) -> dict` (defaults:
OfflineEvalSettings),
`load_draft_for_eval(path, verifier_model, verifier_dir) -> (Eagle3Draft, info)`,
`held_out_check(prompts, prepared_dir, tokenizer) -> dict`, `GreedyMismatchError`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_train.assets.tokenizer import load_tokenizer
from eagle3_train.assets.verifier import Verifier, as_verifier
from eagle3_train.data.chat_mask import end_of_turn_token_id, find_all, user_turn_delimiters
from eagle3_train.evaluate.prompts import EvalPrompt
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.settings import OfflineEvalSettings
from eagle3_train.utils.io import Eagle3InputError, check_at_least
from eagle3_train.utils.progress import progress

log = logging.getLogger(__name__)


class GreedyMismatchError(AssertionError):
    """Speculative decoding produced a different token than plain greedy decoding (and not on a near-tie)."""


# --- loading ----------------------------------------------------------------------------------------------------
def load_draft_for_eval(path: str | Path, verifier_model, verifier_dir: Path | None = None
                        ) -> tuple[Eagle3Draft, dict[str, Any]]:
    """Load a draft for the given (loaded) verifier: one of our checkpoints or run dirs, or an export in the EAGLE
    or speculators format. The frozen embedding is copied from the verifier. Returns (draft, info)."""
    from eagle3_train.checkpoints.formats import fill_default_aux_ids, load_draft_source
    from eagle3_train.checkpoints.native import load_draft, read_metadata, resolve_checkpoint

    path = Path(path).expanduser()
    if not path.exists():
        raise Eagle3InputError(f"draft not found: {path}")
    n_layers = verifier_model.config.get_text_config().num_hidden_layers
    try:
        ckpt = resolve_checkpoint(path)
    except Eagle3InputError:
        ckpt = None
    if ckpt is not None:
        draft = load_draft(ckpt)
        info = {"path": str(ckpt), "format": "eagle3-train", "metadata": read_metadata(ckpt), "notes": []}
    else:
        loaded = load_draft_source(path)
        config = fill_default_aux_ids(loaded.config, n_layers)
        draft = Eagle3Draft(config)
        missing, unexpected = draft.load_state_dict(loaded.tensors, strict=False)
        missing = [k for k in missing if not k.startswith("embed_tokens.")]
        if missing or unexpected:
            raise Eagle3InputError(f"draft {path}: missing tensors {missing}, unexpected tensors {unexpected}")
        if "d2t" not in loaded.tensors:
            raise Eagle3InputError(f"draft {path} has no d2t tensor (the draft-to-verifier vocabulary map)")
        info = {"path": str(loaded.path), "format": loaded.format, "metadata": loaded.metadata,
                "notes": list(loaded.notes)}
    _check_fits(draft, verifier_model, info["path"])
    verifier_embed = verifier_model.get_input_embeddings().weight
    if ckpt is None:  # an export: its own embedding, when it has one, is read apart from its weights
        draft.use_embedding(verifier_embed, loaded.extra.get("embed_tokens.weight"), info["path"])
    elif not draft.config.own_embedding:  # a checkpoint's own embedding came with its weights (load_draft)
        draft.use_embedding(verifier_embed)
    info["aux_layer_ids"] = list(draft.config.aux_layer_ids)
    info["draft_vocab_size"] = draft.config.draft_vocab_size
    return draft, info


def _check_fits(draft: Eagle3Draft, verifier_model, where: str = "draft") -> None:
    """`checkpoints.fit.check_draft_fits_verifier` for a built draft and a loaded verifier."""
    from eagle3_train.checkpoints.fit import check_draft_fits_verifier

    check_draft_fits_verifier(draft.config, verifier_model.config.to_dict(), where,
                              verifier_name=str(getattr(verifier_model.config, "_name_or_path", "") or "the verifier"),
                              tensors=draft.state_dict())


# --- the verifier with aux taps ---------------------------------------------------------------------------------
class TappedVerifier:
    """A HF causal LM whose forward also returns the inputs of the aux layers (= HF hidden_states[i])."""

    def __init__(self, model, aux_layer_ids: tuple[int, ...]):
        from eagle3_train.hidden_states.layers import AuxCapture, decoder_parts

        self.model = model
        self.aux_layer_ids = tuple(aux_layer_ids)
        self._taps = AuxCapture(decoder_parts(model)[1], self.aux_layer_ids)

    @property
    def capture(self) -> bool:
        """False while forwards whose aux states are not needed run (the greedy reference)."""
        return self._taps.enabled

    @capture.setter
    def capture(self, on: bool) -> None:
        self._taps.enabled = on

    def close(self) -> None:
        self._taps.remove()

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.no_grad()
    def __call__(self, ids: list[int], cache, start: int, all_logits: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [L or 1, V] and aux states [L, 3H] (None when not capturing) of `ids` at positions start.."""
        device = self.model.device
        input_ids = torch.tensor([ids], device=device)
        positions = torch.arange(start, start + len(ids), device=device)[None]
        self._taps.captured.clear()
        out = self.model(input_ids=input_ids, position_ids=positions, past_key_values=cache, use_cache=True,
                         logits_to_keep=0 if all_logits else 1)
        aux = self._taps.take()[0] if self.capture else None
        return out.logits[0].float(), aux


# --- decoding ---------------------------------------------------------------------------------------------------
@dataclass
class TurnOutput:
    tokens: list[int]
    seconds: float
    verifier_forwards: int
    drafts: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # drafts equal to the verifier's argmax, past the budget or a stop token too: what vLLM's counters count (it
    # verifies the whole round, then truncates the output)
    matched: int = 0
    rounds: list[dict[str, Any]] = field(default_factory=list)  # filled when record_rounds
    margins: list[float] = field(default_factory=list)  # greedy: top-1 minus top-2 logit per step
    # a thinking model's output: [drafts, accepted] of the rounds that start inside its reasoning and after it
    regions: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class ThinkTags:
    """Token ids that open and close a thinking model's reasoning (`<think>`, `</think>`)."""
    start: int
    end: int

    @classmethod
    def of(cls, tokenizer, start: str = "<think>", end: str = "</think>") -> ThinkTags | None:
        """The tags when each is one token of the vocabulary (a thinking model's), else None."""
        ids = [tokenizer.convert_tokens_to_ids(t) for t in (start, end)]
        if any(not isinstance(i, int) or i == tokenizer.unk_token_id for i in ids):
            return None
        return cls(*ids)

    def reasoning_after(self, ids: list[int], inside: bool = False) -> bool:
        """Whether the text after `ids` is reasoning: a `<think>` not yet closed (`inside`: state before `ids`)."""
        for t in ids:
            if t == self.start:
                inside = True
            elif t == self.end:
                inside = False
        return inside


def _finish(tokens: list[int], new: list[int], stop: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut `new` at the first stop token (kept) or at the token budget; return (kept, done)."""
    for i, t in enumerate(new):
        if t in stop:
            new = new[: i + 1]
            break
    room = max_new_tokens - len(tokens)
    done = len(new) >= room or (bool(new) and new[-1] in stop)
    return new[:room], done


def _margin(logits: torch.Tensor) -> float:
    """The draft's top-1 minus top-2 logit in units of its logits' standard deviation: how close its choice was to a
    tie, which another engine's kernels may break the other way."""
    logits = logits.float()
    top, std = logits.topk(2).values, logits.std()
    return float((top[0] - top[1]) / std) if std > 0 else 0.0  # all equal: a tie


@torch.no_grad()
def chain_decode(verifier: TappedVerifier, draft: Eagle3Draft, prompt_ids: list[int], k: int, max_new_tokens: int,
                 stop: set[int], record_rounds: bool = False, think: ThinkTags | None = None) -> TurnOutput:
    """Greedy chain speculative decoding of one turn (batch size 1); with `think`, each round's drafts and accepted
    tokens are also counted by whether the round starts inside the model's reasoning or after it."""
    t0 = time.perf_counter()
    device = verifier.model.device
    to_target = draft.draft_token_ids().to(device)
    cache = verifier.new_cache()
    logits, aux = verifier(prompt_ids, cache, 0, all_logits=False)
    out = TurnOutput(tokens=[], seconds=0.0, verifier_forwards=1, accepted_per_pos=[0] * k)
    first, done = _finish([], [int(logits[-1].argmax())], stop, max_new_tokens)
    out.tokens += first
    reasoning = think.reasoning_after(prompt_ids + first) if think else False
    ids = list(prompt_ids) + first
    pending = aux  # verifier features of positions draft_len .. len(ids)-2, not yet seen by the draft
    draft_len, kv = 0, None
    dtype = next(draft.parameters()).dtype
    while not done:
        # Step 0 over the new verified positions: features of p with the token at p+1.
        h = draft.fuse(pending[None].to(dtype))
        step_ids = torch.tensor([ids[draft_len + 1:]], device=device)
        pos = torch.arange(draft_len, len(ids) - 1, device=device)[None]
        d_logits, h_next, kv = draft.forward_cached(h, step_ids, pos, kv)
        draft_len = len(ids) - 1
        proposal = [int(to_target[d_logits[0, -1].argmax()])]
        margins = [_margin(d_logits[0, -1])] if record_rounds else []
        h = h_next[:, -1:]
        for j in range(1, k):
            d_logits, h, kv = draft.forward_cached(h, torch.tensor([[proposal[-1]]], device=device),
                                                   torch.tensor([[draft_len - 1 + j]], device=device), kv)
            proposal.append(int(to_target[d_logits[0, -1].argmax()]))
            if record_rounds:
                margins.append(_margin(d_logits[0, -1]))
        # Verification of [last, d_1..d_k] in one forward.
        v_logits, aux = verifier([ids[-1]] + proposal, cache, len(ids) - 1)
        out.verifier_forwards += 1
        greedy = v_logits.argmax(-1).tolist()
        a = 0
        while a < k and proposal[a] == greedy[a]:
            a += 1
        new, done = _finish(out.tokens, proposal[:a] + [greedy[a]], stop, max_new_tokens)
        counted = min(a, len(new))  # drafts that were accepted AND emitted (none past a stop token or the budget)
        out.drafts += 1
        out.matched += a
        for i in range(counted):
            out.accepted_per_pos[i] += 1
        if think:
            tally = out.regions.setdefault("reasoning" if reasoning else "answer", [0, 0])
            tally[0], tally[1] = tally[0] + 1, tally[1] + counted
            reasoning = think.reasoning_after(new, reasoning)
        if record_rounds:
            out.rounds.append({"start": len(out.tokens), "proposal": proposal, "accepted": counted, "matched": a,
                               "emitted": new, "draft_margins": margins})
        out.tokens += new
        ids += new
        if a < k:  # drop the rejected drafts; crop(0) would empty the cache in some transformers versions
            cache.crop(a - k)
        kv = [(kk[:, :, :draft_len], vv[:, :, :draft_len]) for kk, vv in kv]
        pending = aux[: a + 1]
    out.seconds = time.perf_counter() - t0
    return out


@torch.no_grad()
def greedy_decode(verifier: TappedVerifier, prompt_ids: list[int], max_new_tokens: int, stop: set[int]
                  ) -> TurnOutput:
    """Plain greedy decoding with the verifier's KV cache, one token per forward (the reference)."""
    t0 = time.perf_counter()
    verifier.capture = False
    try:
        cache = verifier.new_cache()
        logits, _ = verifier(prompt_ids, cache, 0, all_logits=False)
        out = TurnOutput(tokens=[], seconds=0.0, verifier_forwards=1)
        while True:
            top = logits[-1].topk(2)
            out.margins.append(float(top.values[0] - top.values[1]))
            new, done = _finish(out.tokens, [int(top.indices[0])], stop, max_new_tokens)
            out.tokens += new
            if done:
                break
            logits, _ = verifier(new, cache, len(prompt_ids) + len(out.tokens) - 1, all_logits=False)
            out.verifier_forwards += 1
    finally:
        verifier.capture = True
    out.seconds = time.perf_counter() - t0
    return out


@torch.no_grad()
def compare_with_greedy(verifier: TappedVerifier, prompt_ids: list[int], spec: list[int], greedy: TurnOutput,
                        tie_tol: float) -> dict[str, Any] | None:
    """None when identical; else the first differing position with the logit gaps that explain it."""
    ref = greedy.tokens
    if spec == ref:
        return None
    i = next((j for j, (a, b) in enumerate(zip(spec, ref)) if a != b), min(len(spec), len(ref)))
    info: dict[str, Any] = {"position": i, "spec_len": len(spec), "greedy_len": len(ref)}
    if i < len(spec) and i < len(ref):
        # Recompute the logits at that position over the whole common prefix in one forward (no cache).
        verifier.capture = False
        try:
            logits, _ = verifier(list(prompt_ids) + ref[:i], verifier.new_cache(), 0, all_logits=False)
        finally:
            verifier.capture = True
        g, s = ref[i], spec[i]
        gap = float(logits[-1, g] - logits[-1, s])
        margin = greedy.margins[i] if i < len(greedy.margins) else None
        info.update(greedy_token=g, spec_token=s, full_forward_logit_gap=gap, greedy_top2_margin=margin,
                    near_tie=abs(gap) < tie_tol or (margin is not None and margin < tie_tol))
    else:
        info["near_tie"] = False  # one stopped early: a length difference is not a near-tie
    return info


# --- bookkeeping ------------------------------------------------------------------------------------------------
@dataclass
class Tally:
    """Acceptance counters of a set of turns; `summary` uses the names of vLLM's spec-decode metrics."""
    k: int
    num_drafts: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    new_tokens: int = 0
    verifier_forwards: int = 0
    prefills: int = 0
    seconds: float = 0.0
    turns: int = 0
    regions: dict[str, list[int]] = field(default_factory=dict)  # reasoning / answer: [drafts, accepted]

    def __post_init__(self) -> None:
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.k

    def add(self, t: TurnOutput) -> None:
        self.num_drafts += t.drafts
        if t.accepted_per_pos:  # greedy reference turns have no drafts
            self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, t.accepted_per_pos)]
        self.new_tokens += len(t.tokens)
        self.verifier_forwards += t.verifier_forwards
        self.prefills += 1
        self.seconds += t.seconds
        self.turns += 1
        for name, (drafts, accepted) in t.regions.items():
            tally = self.regions.setdefault(name, [0, 0])
            tally[0], tally[1] = tally[0] + drafts, tally[1] + accepted

    def summary(self) -> dict[str, Any]:
        d, acc = self.num_drafts, sum(self.accepted_per_pos)
        decode_fwd = self.verifier_forwards - self.prefills
        return {
            "turns": self.turns,
            "num_drafts": d,
            "num_draft_tokens": d * self.k,
            "num_accepted_tokens": acc,
            "num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "mean_acceptance_length": 1.0 + acc / d if d else None,
            "draft_acceptance_rate": acc / (d * self.k) if d else None,
            "per_position_acceptance": [a / d for a in self.accepted_per_pos] if d else None,
            "new_tokens": self.new_tokens,
            "verifier_forwards": self.verifier_forwards,
            # Decode only: the prefill forward of each turn yields one token whatever the draft does.
            "tokens_per_verifier_forward": (self.new_tokens - self.prefills) / decode_fwd if decode_fwd else None,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": self.new_tokens / self.seconds if self.seconds else None,
            # a thinking model: acceptance inside its reasoning and in its answer (rounds by where they start)
            **({"by_region": {name: {"num_drafts": d_, "num_accepted_tokens": a_,
                                     "mean_acceptance_length": 1.0 + a_ / d_ if d_ else None}
                              for name, (d_, a_) in sorted(self.regions.items())}} if self.regions else {}),
        }


# --- prompts and stop tokens ------------------------------------------------------------------------------------
def render_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    if not tokenizer.chat_template:
        raise Eagle3InputError("the verifier's tokenizer has no chat template; offline evaluation renders prompts "
                               "with it (add chat_template.jinja to the verifier directory)")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template already holds BOS etc.


def stop_token_ids(tokenizer, model) -> set[int]:
    """EOS ids of the tokenizer and generation config, plus the chat template's end-of-turn token."""
    stop: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            stop.add(value)
        elif value:
            stop.update(int(v) for v in value)
    if tokenizer.chat_template:
        eot = end_of_turn_token_id(tokenizer)
        if eot is not None:
            stop.add(eot)
    return stop


# --- held-out check ---------------------------------------------------------------------------------------------
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


def held_out_check(prompts: list[EvalPrompt], prepared_dir: str | Path, tokenizer) -> dict[str, Any]:
    """Exact (whitespace-normalized) match of each prompt's user turns against the user turns of the prepared
    training data; `held_out` is True when no prompt turn occurs in the train split."""
    from eagle3_train.data.prepare import load_prepared

    prepared_dir = Path(prepared_dir)
    dd, manifest = load_prepared(prepared_dir)
    template = None
    source = (manifest.get("tokenizer") or {}).get("chat_template_source", "tokenizer")
    notes = []
    if source not in ("tokenizer", None):
        if Path(source).is_file():
            template = Path(source).read_text()
        else:
            notes.append(f"prepared with chat template {source!r}, not available here: used the tokenizer's")
    header, end = user_turn_delimiters(tokenizer, template)
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


# --- the evaluation ---------------------------------------------------------------------------------------------
def load_verifier(verifier: str | Path | Verifier, device: str = "cpu", dtype: torch.dtype = torch.float32,
                  trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    from eagle3_train.assets.verifier import from_pretrained

    vdir = as_verifier(verifier).path
    tokenizer = load_tokenizer(vdir, trust_remote_code)
    model = from_pretrained(AutoModelForCausalLM, vdir, trust_remote_code, dtype=dtype).to(device).eval()
    return vdir, tokenizer, model


_D = OfflineEvalSettings  # keyword defaults below are the settings dataclass's


def evaluate_offline(draft: str | Path | Eagle3Draft, verifier: str | Path, prompts: list[EvalPrompt], k: int = _D.k,
                     max_new_tokens: int = _D.max_new_tokens, device: str = _D.device,
                     dtype: torch.dtype = getattr(torch, _D.dtype), check_greedy: bool = _D.check_greedy,
                     prepared: str | Path | None = _D.prepared, tie_tol: float = _D.tie_tol,
                     record_rounds: bool = False, verifier_model=None, tokenizer=None,
                     trust_remote_code: bool = _D.trust_remote_code,
                     think: ThinkTags | None = None) -> dict[str, Any]:
    """Acceptance of `draft` for `verifier` on `prompts` by chain speculative decoding (see the module docstring).

    `draft`: a checkpoint/run dir, an exported dir (EAGLE or speculators format) or a ready Eagle3Draft (used as is,
    embedding included). `prepared`: the prepared data to test the prompts against (default: the draft's
    training_metadata `data.prepared`). `think`: the reasoning tags whose rounds are counted apart (`by_region`;
    default: `<think>`/`</think>` when each is one token of the verifier's vocabulary). Raises GreedyMismatchError
    when the output differs from greedy decoding other than on a near-tie (logit gap < tie_tol); near-tie
    differences are reported in `greedy_check`.
    """
    check_at_least("k (draft tokens per round)", k, 1)
    check_at_least("max_new_tokens", max_new_tokens, 1)
    if not prompts:
        raise Eagle3InputError("no prompts to evaluate")
    if verifier_model is None:
        vdir, tokenizer, verifier_model = load_verifier(verifier, device, dtype, trust_remote_code)
    else:
        vdir = Path(verifier)
        if tokenizer is None:
            tokenizer = load_tokenizer(vdir, trust_remote_code)
    if isinstance(draft, Eagle3Draft):
        _check_fits(draft, verifier_model)
        draft_info: dict[str, Any] = {"path": None, "format": "module", "metadata": None, "notes": []}
    else:
        draft, draft_info = load_draft_for_eval(draft, verifier_model, vdir)
    draft = draft.to(device=device, dtype=dtype).eval()
    metadata = draft_info.pop("metadata", None) or {}
    if prepared is None:
        prepared = (metadata.get("data") or {}).get("prepared")
    held = _held_out(prompts, prepared, tokenizer)

    tapped = TappedVerifier(verifier_model, draft.config.aux_layer_ids)
    stop = stop_token_ids(tokenizer, verifier_model)
    if think is None:
        think = ThinkTags.of(tokenizer)
    run = _OfflineRun(tapped, draft, tokenizer, stop, k=k, max_new_tokens=max_new_tokens, check_greedy=check_greedy,
                      tie_tol=tie_tol, record_rounds=record_rounds, think=think)
    records: list[dict[str, Any]] = []
    bar = progress(total=len(prompts), desc="offline eval", unit="prompt")
    try:
        for p in prompts:
            records.append(run.prompt(p))
            bar.update(1)
            bar.set_postfix_str(f"{run.overall.new_tokens / max(run.overall.seconds, 1e-9):.1f} tok/s, "
                                f"τ={run.overall.summary()['mean_acceptance_length'] or 0:.2f}")
    finally:
        bar.close()
        tapped.close()

    summary = run.overall.summary()
    return {
        "mode": "offline",
        "settings": {"k": k, "max_new_tokens": max_new_tokens, "device": str(device), "dtype": str(dtype),
                     "num_prompts": len(prompts), "check_greedy": check_greedy, "tie_tol": tie_tol},
        "draft": draft_info,
        "verifier": {"path": str(vdir), "num_layers": verifier_model.config.get_text_config().num_hidden_layers},
        "stop_token_ids": sorted(stop),
        "overall": summary,
        "benchmarks": {name: t.summary() for name, t in run.by_benchmark.items()},
        "held_out": held.get("held_out"),
        "held_out_check": held,
        "greedy_check": {"checked": check_greedy, "passed": (not run.mismatches) if check_greedy else None,
                         "mismatches": run.mismatches},
        "speed": run.speed(summary),
        "prompts": records,
    }


def _held_out(prompts: list[EvalPrompt], prepared: str | Path | None, tokenizer) -> dict[str, Any]:
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


class _OfflineRun:
    """Decodes the prompts one turn at a time and keeps the tallies (overall, per benchmark, greedy reference)."""

    def __init__(self, tapped: TappedVerifier, draft: Eagle3Draft, tokenizer, stop: set[int], *, k: int,
                 max_new_tokens: int, check_greedy: bool, tie_tol: float, record_rounds: bool,
                 think: ThinkTags | None) -> None:
        self.tapped, self.draft, self.tokenizer, self.stop = tapped, draft, tokenizer, stop
        self.k, self.max_new_tokens, self.check_greedy = k, max_new_tokens, check_greedy
        self.tie_tol, self.record_rounds = tie_tol, record_rounds
        self.think = think
        self.overall, self.greedy = Tally(k), Tally(k)
        self.by_benchmark: dict[str, Tally] = {}
        self.mismatches: list[dict[str, Any]] = []

    def prompt(self, p: EvalPrompt) -> dict[str, Any]:
        """Every turn of one prompt; turn 2 follows the model's own answer to turn 1."""
        messages: list[dict[str, str]] = []
        rec: dict[str, Any] = {"id": p.id, "benchmark": p.benchmark, "turns": []}
        for t, turn in enumerate(p.turns):
            messages.append({"role": "user", "content": turn})
            turn_rec = self.turn(p, t, render_prompt(self.tokenizer, messages))
            rec["turns"].append(turn_rec)
            messages.append({"role": "assistant", "content": turn_rec["output"]})
        return rec

    def turn(self, p: EvalPrompt, t: int, prompt_ids: list[int]) -> dict[str, Any]:
        spec = chain_decode(self.tapped, self.draft, prompt_ids, self.k, self.max_new_tokens, self.stop,
                            self.record_rounds, self.think)
        self.overall.add(spec)
        self.by_benchmark.setdefault(p.benchmark, Tally(self.k)).add(spec)
        turn_rec: dict[str, Any] = {"prompt_tokens": len(prompt_ids), "new_tokens": len(spec.tokens),
                                    "drafts": spec.drafts, "accepted": sum(spec.accepted_per_pos),
                                    "matched": spec.matched,
                                    "verifier_forwards": spec.verifier_forwards,
                                    "seconds": round(spec.seconds, 3)}
        if self.check_greedy:
            turn_rec["greedy_identical"] = self.same_as_greedy(p, t, prompt_ids, spec)
        if self.record_rounds:
            turn_rec["tokens"] = spec.tokens
            turn_rec["rounds"] = spec.rounds
        turn_rec["output"] = self.tokenizer.decode([x for x in spec.tokens if x not in self.stop],
                                                   skip_special_tokens=True)
        return turn_rec

    def same_as_greedy(self, p: EvalPrompt, t: int, prompt_ids: list[int], spec: TurnOutput) -> bool:
        """Whether the speculative output equals greedy decoding; raises GreedyMismatchError unless on a near-tie."""
        ref = greedy_decode(self.tapped, prompt_ids, self.max_new_tokens, self.stop)
        self.greedy.add(ref)
        diff = compare_with_greedy(self.tapped, prompt_ids, spec.tokens, ref, self.tie_tol)
        if diff is None:
            return True
        diff = {"prompt": p.id, "turn": t + 1, **diff}
        self.mismatches.append(diff)
        if not diff["near_tie"]:
            raise GreedyMismatchError(f"prompt {p.id} turn {t + 1}: speculative output differs from greedy decoding "
                                      f"at new token {diff['position']}: {diff}")
        log.warning("near-tie difference from greedy decoding: %s", diff)
        return False

    def speed(self, summary: dict[str, Any]) -> dict[str, Any]:
        speed: dict[str, Any] = {"speculative_tokens_per_s": summary["tokens_per_s"],
                                 "speculative_seconds": summary["seconds"]}
        if self.check_greedy and self.greedy.seconds:
            g = self.greedy.summary()
            speed.update(greedy_tokens_per_s=g["tokens_per_s"], greedy_seconds=g["seconds"],
                         wall_speedup=g["seconds"] / summary["seconds"] if summary["seconds"] else None)
        return speed
