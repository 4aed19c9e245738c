"""How a draft proposes its k tokens, as data, one entry per method: what it adds to the EAGLE-3 network, what its
training-time-test steps after the first read, what its exports carry and how the engines serve it. Torch-free (the
settings and the config checks read it); its two torch hooks work on the tensors they are given. Nothing else names
a method.

- `eagle3`: sequential EAGLE-3. Step j (j >= 1) reads the draft's own hidden state of step j-1 and the token drafted
  before it (training: the data's token); k forwards per round.
- `dflash`: DFlash (block diffusion drafting, z-lab/dflash): its own network (`model/dflash.py`) and objective
  (`train/dflash_blocks.py`): the verified token and block_size-1 mask slots in one non-causal forward over context
  features of the verifier's states; `num_speculative_tokens` = block_size - 1.
- `peagle`: P-EAGLE (parallel drafting, arXiv 2602.01469). Steps j >= 1 read a mask token and the learned
  `mask_hidden` (raw aux width, fused like verifier features): no step depends on an earlier step's output, so vLLM
  drafts all k tokens in one forward (`"parallel_drafting": true`). Its training-time-test step j at position t is
  the P-EAGLE row (anchor t, depth j): RoPE position t+j, attention to the causal prefix and to the same anchor's
  depths 1..j (`model/ttt_attention.py`), the target the verifier's distribution at t+1+j. The token embedding stays
  the verifier's, frozen (as vLLM shares it): the paper also trains the embedding, but a mask slot's input is
  cat(norm(embed[mask]), norm(fc(mask_hidden))) and fc(mask_hidden) spans the whole hidden width, so what a mask
  slot can say is learned through `mask_hidden` alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eagle3_train.utils.io import Eagle3InputError


def _eagle3_later_step(model: Any, out: Any, ids: Any) -> tuple[Any, Any]:
    return model.next_hidden(out), ids


def _peagle_later_step(model: Any, out: Any, ids: Any) -> tuple[Any, Any]:
    h = model.fuse(model.mask_hidden.to(out.dtype)).expand_as(out)
    return h, ids.new_full(ids.shape, model.config.mask_token_id)


def _eagle3_propose(draft: Any, h: Any, ids: Any, pos: Any, kv: Any, k: int, to_target: Any) -> tuple[list, Any]:
    """k forwards: the verified positions' step 0, then one position per drafted token."""
    logits, h_next, kv = draft.forward_cached(h, ids, pos, kv)
    out = [logits[0, -1]]
    for j in range(1, k):
        token = to_target[out[-1].argmax()].view(1, 1)
        logits, h_next, kv = draft.forward_cached(h_next[:, -1:], token, pos[:, -1:] + j, kv)
        out.append(logits[0, -1])
    return out, kv


def _peagle_propose(draft: Any, h: Any, ids: Any, pos: Any, kv: Any, k: int, to_target: Any) -> tuple[list, Any]:
    """One forward, as vLLM's parallel drafting lays it out: the verified positions (the last reads the bonus token),
    then k-1 mask slots at the next positions, causal."""
    import torch

    n = k - 1
    mask_h = draft.fuse(draft.mask_hidden.to(h.dtype)).expand(1, n, -1)
    ids = torch.cat([ids, ids.new_full((1, n), draft.config.mask_token_id)], dim=1)
    pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, k, device=pos.device)], dim=1)
    logits, _, kv = draft.forward_cached(torch.cat([h, mask_h], dim=1), ids, pos, kv)
    return list(logits[0, -k:]), kv


def _dflash_propose(draft: Any, h: Any, ids: Any, pos: Any, kv: Any, k: int, to_target: Any) -> tuple[list, Any]:
    """One block forward: the new verified positions become context keys/values, the bonus token (the last of
    `ids`) anchors a block of k mask slots after them."""
    return draft.propose_block(kv, h, pos, int(ids[0, -1]), k)


def _no_later_step(model: Any, out: Any, ids: Any) -> tuple[Any, Any]:
    raise NotImplementedError("this method is not trained by training-time test")


@dataclass(frozen=True)
class DraftMethod:
    name: str
    describe: str
    # step j >= 1 of training-time test: (model, step j-1's layer output, the data's tokens for step j) -> (hidden,
    # token ids) that step j reads; serving feeds the same
    later_step: Callable[[Any, Any, Any], tuple[Any, Any]]
    # offline decoding, as vLLM drafts: (draft, fused features of the new verified positions, their next tokens,
    # positions, KV cache, k, draft row -> token id) -> (the k draft-vocab logits, KV cache); the caller crops the
    # cache back to the verified positions
    propose: Callable[..., tuple[list, Any]]
    # a step's input depends on the token drafted before it (training feeds the data's: the chain metrics stop where
    # the data's token is not what serving would draft)
    chained: bool
    # own parameters beyond EAGLE-3's: name -> (shape from a config, initial standard deviation)
    parameters: dict[str, tuple[Callable[[Any], tuple[int, ...]], float]] = field(default_factory=dict)
    needs_mask_token: bool = False
    vllm_options: dict[str, Any] = field(default_factory=dict)  # keys it adds to vLLM's --speculative-config
    speculators_type: str = "eagle3"  # speculators_model_type / speculators_config.algorithm
    speculators_class: str = "Eagle3Speculator"
    network: str = "eagle3"  # the module that runs it (model/draft.py `build_draft`)
    objective: str = "ttt"  # the objective that trains it (train/method_objectives.py)
    layout: str = "eagle3"  # its export layout (checkpoints/layouts.py)
    vllm_method: str = "eagle3"  # the "method" of vLLM's --speculative-config
    block: bool = False  # it drafts a fixed block (DFlash: num_speculative_tokens must be block_size - 1)
    speculators_refusal: str | None = None  # why it is not exported in the speculators format
    sglang_refusal: str | None = None  # why SGLang would not serve it as trained (None: as the layer kind says)
    speculators_drops: dict[str, str] = field(default_factory=dict)  # option -> why vLLM loses it in that format

    def shapes(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        """Its own tensors (our names = the engines' names) with their shapes."""
        return {name: shape(cfg) for name, (shape, _) in self.parameters.items()}

    def config_fields(self, cfg: Any) -> dict[str, Any]:
        """The config.json keys it adds to an EAGLE-3 layout, in both formats."""
        return {"mask_token_id": cfg.mask_token_id} if self.needs_mask_token else {}

    def block_size_for(self, steps: int) -> int | None:
        """The block a block method trains with `steps` mask slots (the verified token and the slots); None else."""
        return steps + 1 if self.block else None

    def speculative_config(self, model: str, k: int) -> dict[str, Any]:
        """vLLM's `--speculative-config` for a draft of this method at `model`, drafting k tokens."""
        return {"method": self.vllm_method, "model": model, "num_speculative_tokens": k, **self.vllm_options}

    def served_k(self, config: dict[str, Any], k: int) -> int:
        """The num_speculative_tokens to serve an export (its config.json) with, asked for k: a block method's is
        fixed by its block (a non-causal block changes every slot's attention with its size)."""
        if not self.block:
            return k
        fixed = int(config["block_size"]) - 1
        if k != fixed:
            raise Eagle3InputError(f"a {self.name} draft of block size {fixed + 1} drafts {fixed} tokens per round "
                                   f"(its mask slots attend to each other both ways): serve it with "
                                   f"num_speculative_tokens {fixed}, not {k}")
        return fixed

    def check(self, cfg: Any) -> None:
        if self.block != (cfg.block_size is not None):
            raise Eagle3InputError(f"block_size is for the methods that draft a block "
                                   f"({', '.join(n for n, m in METHODS.items() if m.block)}), and they need one "
                                   f"(method {self.name}, block_size {cfg.block_size!r})")
        if self.block and (not isinstance(cfg.block_size, int) or cfg.block_size < 2):
            raise Eagle3InputError(f"block_size must be a whole number >= 2, got {cfg.block_size!r}")
        if not self.needs_mask_token:
            if cfg.mask_token_id is not None:
                raise Eagle3InputError(f"mask_token_id is for the methods that draft from mask tokens "
                                       f"({', '.join(n for n, m in METHODS.items() if m.needs_mask_token)}), "
                                       f"not {self.name}")
            return
        m = cfg.mask_token_id
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m < cfg.vocab_size:
            raise Eagle3InputError(f"method {self.name} needs mask_token_id, a token id in 0..{cfg.vocab_size - 1} "
                                   f"of the verifier's vocabulary, got {m!r}")


METHODS: dict[str, DraftMethod] = {m.name: m for m in (
    DraftMethod("eagle3", "sequential EAGLE-3: step j reads the draft's own step j-1", _eagle3_later_step,
                _eagle3_propose, chained=True),
    DraftMethod(
        "peagle", "P-EAGLE: all k drafts in one forward from mask tokens and the learned mask_hidden",
        _peagle_later_step, _peagle_propose, chained=False,
        parameters={"mask_hidden": (lambda cfg: (1, 3 * cfg.aux_hidden_size), 1.0)},  # randn, as the references
        needs_mask_token=True, vllm_options={"parallel_drafting": True},
        speculators_type="peagle", speculators_class="PeagleSpeculator",
        speculators_drops={"fc_norm": "vLLM's reader of speculators peagle configs (update_peagle, 0.32) does not pass "
                                      "fc_norm on: export --format eagle"},
        sglang_refusal="SGLang has no parallel drafting (its source read 2026-12: P-EAGLE is issue #23171, PR "
                       "#27498 open); its EAGLE-3 loader skips mask_hidden without a word and would draft "
                       "sequentially from a draft never trained on its own hidden states"),
    DraftMethod(
        "dflash", "DFlash: a block of mask slots drafted in one non-causal forward over the context features",
        _no_later_step, _dflash_propose, chained=False, needs_mask_token=True, network="dflash",
        objective="blocks", layout="dflash", vllm_method="dflash", block=True,
        speculators_refusal="vLLM 0.32 reads a speculators-format DFlash draft as causal (update_dflash; fix open "
                            "in vLLM PR #56692) while DFlash trains its blocks both ways: export --format eagle (the "
                            "z-lab layout vLLM loads)",
        sglang_refusal="the export is the z-lab layout vLLM 0.32 loads (DFlashDraftModel); SGLang's DFlash "
                       "loader was not read or run here"),
)}
NAMES = tuple(METHODS)


def method_of_config(config: dict[str, Any]) -> DraftMethod:
    """The method of an exported draft's config.json (either format): what the engine must be told to serve it."""
    if str((config.get("architectures") or [""])[0]).startswith("DFlash"):
        return METHODS["dflash"]
    by_type = [m for m in METHODS.values() if m.speculators_type == config.get("speculators_model_type")]
    has_mask = any(config.get(k) is not None for k in ("mask_token_id", "pard_token"))
    return by_type[0] if by_type else next(m for m in METHODS.values() if m.needs_mask_token == has_mask
                                           and not m.block)


def draft_method(name: str) -> DraftMethod:
    try:
        return METHODS[name]
    except KeyError:
        raise Eagle3InputError(f"draft method must be one of {', '.join(NAMES)}, got {name!r}") from None
