"""Greedy chain speculative decoding of one turn (batch size 1) with an HF verifier and our draft, the plain greedy
reference it must equal, and the acceptance counters, so offline acceptance is measured the way vLLM serves EAGLE-3.

Each round (as vLLM runs EAGLE-3 with a chain of k tokens):
1. Draft step 0 over every position p whose verifier features are new: fuse(aux_p) with the embedding of token p+1
   at RoPE position p (ids shifted left by one; the last one is the token the verifier just produced). Steps 1..k-1
   feed the previous draft hidden state and the draft's own token (mapped to verifier ids) at position +1 (P-EAGLE:
   k-1 mask slots in the same forward; `model/draft_methods.py`).
2. The verifier reads [last token, d_1..d_k] in one forward with its KV cache; the longest prefix of drafts equal to
   its argmax is accepted and its next argmax (the bonus token) is emitted too.
3. Both caches are cropped: the verifier's to the accepted tokens, the draft's to the positions it computed from
   verifier features (the others are recomputed from verifier features next round, as vLLM does).

Python API: `TappedVerifier(model, aux_layer_ids)`, `chain_decode(verifier, draft, prompt_ids, k, max_new_tokens,
stop, ...) -> TurnOutput`, `greedy_decode(...) -> TurnOutput`, `compare_with_greedy(...) -> dict | None`,
`ThinkTags.of(tokenizer)`, `Tally(k)`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3_train.model.draft import Eagle3Draft


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
        drafted, kv = draft.method.propose(draft, h, step_ids, pos, kv, k, to_target)  # model/draft_methods.py
        draft_len = len(ids) - 1
        proposal = [int(to_target[d.argmax()]) for d in drafted]
        margins = [_margin(d) for d in drafted] if record_rounds else []
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
