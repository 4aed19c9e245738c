"""Finetune from an existing EAGLE-3 draft (ours, EAGLE/SpecForge/SGLang, speculators) and record where it came from.

`Trainer.__init__` does, when `train.finetune_from` is set:
    source = load_finetune_source(cfg, inputs)       # read the source and check it fits THIS verifier; nothing built
    model = build_model(cfg, inputs, overrides=source.draft_overrides, vocab=source.vocab)
    init = apply_finetune_source(model, cfg, inputs, source)   # load the weights; the `init` record of the run
`finetune_model(cfg, inputs) -> (model, init)` does the three steps.

Policies:
- Architecture: the draft follows the SOURCE (layers, intermediate size, heads, rope, eps, norm_before_residual,
  norm_before_fc, fc_norm, norm_output); the run's `train.*` architecture settings are replaced (noted if they differ).
- Must match this verifier, else one Eagle3InputError before any training: hidden size (`fc.weight`), vocabulary
  size (`t2d`, `embed_tokens.weight`), and the aux layers (the source's ids must equal the extracted `layer_ids`,
  unless `allow_aux_layer_mismatch`; recorded as `init.aux_layers`). Source ids: top-level
  `eagle_aux_hidden_state_layer_ids` = vLLM's "input of layer i"; only nested `eagle_config.…` = SGLang's "output of
  layer i" (= input of i+1); both = must name the same layers; neither = the engines' default (2, L//2, L-3).
- Tensors: every tensor of the built draft must come from the source; missing ones stop the run unless
  `allow_missing` (they then keep their fresh initialisation). `embed_tokens.weight` is never loaded (the verifier's
  embedding is used; a warning when they differ) and `*.rotary_emb.inv_freq` is recomputed; both are listed as
  ignored. Any other tensor we cannot place stops the run unless `allow_missing` (then ignored, listed and warned).
- Vocabulary: `keep` uses the source's d2t/t2d and lm_head as they are (the run's vocab file is not used); `rebuild`
  uses the run's d2t/t2d and remaps lm_head rows by token id: shared tokens keep their trained row, new tokens start
  from the verifier's output row (or stay random with `lm_head_init: random`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3_train.checkpoints.fit import check_draft_fits_verifier, verifier_dims
from eagle3_train.checkpoints.formats import (
    AUX_DEFAULT,
    AUX_DFLASH,
    AUX_NESTED,
    AUX_NESTED_VLLM,
    AUX_OURS,
    AUX_TOP,
    LoadedDraft,
    fill_default_aux_ids,
    load_draft_source,
    load_tensor_data,
    source_summary,
)
from eagle3_train.model.draft_methods import draft_method
from eagle3_train.model.layer_kinds import MLA_DIMS
from eagle3_train.utils.finite import check_finite
from eagle3_train.utils.io import Eagle3InputError

log = logging.getLogger(__name__)

VOCAB_POLICIES = ("keep", "rebuild")
# DraftConfig fields taken from the source: they shape the weights or change what the network computes.
ARCH_FIELDS = ("architecture", *MLA_DIMS, "hidden_size", "target_hidden_size", "num_layers", "intermediate_size",
               "num_attention_heads",
               "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
               "max_position_embeddings", "hidden_act", "norm_before_residual", "norm_before_fc", "fc_norm",
               "norm_output")
# TrainConfig settings that the source's values replace.
RUN_ARCH_SETTINGS = ("hidden_size", "num_layers", "intermediate_size", "norm_before_residual", "norm_before_fc",
                     "fc_norm", "norm_output")
_VOCAB_KEYS = ("d2t", "t2d")
_NOT_LOADED = ("embed_tokens.weight",)


@dataclass
class FinetuneSource:
    """A source draft read and checked against the run's verifier, ready to be loaded into a built model."""
    loaded: LoadedDraft
    draft_overrides: dict[str, Any]  # DraftConfig fields for build_model
    vocab: tuple[torch.Tensor, torch.Tensor] | None  # (d2t, t2d) to build with: the source's (keep), None (rebuild)
    d2t: torch.Tensor  # the source's mapping, checked
    t2d: torch.Tensor
    summary: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    aux_layers: dict[str, Any] = field(default_factory=dict)  # where the features came from vs. the run's layers

# `keep` with a source vocabulary that holds less than this share of the run's own draft vocabulary warns (and the
# training metadata records it): the source was built on other data (Kimi-K2's 32K for Kimi-K2.5 reasoning, say).
KEEP_OVERLAP_WARN = 0.9

def _warn(notes: list[str], msg: str) -> None:
    log.warning("finetune: %s", msg)
    notes.append(msg)


def _layers(ids) -> str:
    ids = list(ids)
    return f"inputs of verifier layers {ids} (= outputs of layers {[i - 1 for i in ids]})"


def aux_layer_record(loaded: LoadedDraft, inputs, L: int, allow_mismatch: bool, notes: list[str]) -> dict[str, Any]:
    """Which verifier layers the source's features came from, which the run extracted, and whether they agree.

    Refuses a disagreement (the fc would fuse other layers than it learned) unless `allow_mismatch`; the record goes
    into the run's `init.aux_layers` either way.
    """
    src, run = list(loaded.config.aux_layer_ids), list(inputs.layer_ids)
    sc = loaded.source_config
    origin = {AUX_OURS: "from its draft_config.json (vLLM convention)",
              AUX_TOP: "from its config's top-level eagle_aux_hidden_state_layer_ids (vLLM convention: input of layer "
                       "i)" + (", and eagle_config's agree" if (sc.get("eagle_config") or {}).get(
                           "eagle_aux_hidden_state_layer_ids") else ""),
              AUX_NESTED: "from eagle_config.eagle_aux_hidden_state_layer_ids only (SGLang convention: output of layer "
                          "i, shifted by +1)",
              AUX_NESTED_VLLM: "from eagle_config.eagle_aux_hidden_state_layer_ids only, which TorchSpec's vLLM export "
                               "writes in vLLM's convention (input of layer i; as SGLang ids they would be one "
                               "layer later)",
              AUX_DFLASH: "from dflash_config.target_layer_ids (DFlash: output of layer i, which vLLM shifts by +1)",
              AUX_DEFAULT: f"its config names none, so the engines' default (2, L//2, L-3) for this {L}-layer verifier"
              }[loaded.aux_ids_origin]
    record = {"source": src, "source_origin": loaded.aux_ids_origin, "source_explained": f"{_layers(src)}, {origin}",
              "source_config_keys": {
                  "eagle_aux_hidden_state_layer_ids": sc.get("eagle_aux_hidden_state_layer_ids"),
                  "eagle_config.eagle_aux_hidden_state_layer_ids": (sc.get("eagle_config") or {}).get(
                      "eagle_aux_hidden_state_layer_ids"),
                  **({"dflash_config.target_layer_ids": sc["dflash_config"].get("target_layer_ids")}
                     if sc.get("dflash_config") else {})},
              "run": run, "run_from": f"layer_ids of the hidden-states manifest in {inputs.hidden_dir}",
              "match": src == run, "allow_mismatch": bool(allow_mismatch)}
    where = f"finetune source {loaded.path}"
    log.info("finetune: the source's features came from %s, %s; this run trains on %s (%s)", _layers(src), origin,
             _layers(run), record["run_from"])
    problem = None
    if max(src) > L:
        problem = (f"{where}: the draft reads verifier layers {src} ({origin}), but verifier {inputs.verifier.name} "
                   f"has only {L} layers: it was made for a deeper verifier")
    elif src != run:
        ids = ",".join(map(str, src))
        problem = (f"{where}: the draft was trained on {_layers(src)} ({origin}), but the hidden states in "
                   f"{inputs.hidden_dir} hold {_layers(run)}: its fc would fuse other layers than it learned. "
                   f"Re-extract with `eagle3-train extract --layer-ids {ids}` or choose another source")
    if problem and not allow_mismatch:
        raise Eagle3InputError(problem + "; or pass --allow-aux-layer-mismatch to finetune on the run's layers "
                                         "anyway (recorded in the training metadata).")
    if problem:
        _warn(notes, problem + "; finetuning on the run's layers anyway (allow_aux_layer_mismatch, recorded)")
    recorded = loaded.config.verifier_num_layers
    if loaded.aux_ids_origin == AUX_OURS and recorded and recorded != L:
        _warn(notes, f"the source was trained for a verifier with {recorded} layers; {inputs.verifier.name} has {L}")
    return record


def _source_vocab(loaded: LoadedDraft, V: int, notes: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The source's (d2t, t2d), checked: d2t is what the engines serve with, so t2d follows it."""
    where = f"finetune source {loaded.path}"
    d2t, t2d = loaded.tensors.get("d2t"), loaded.tensors.get("t2d")
    lm = loaded.tensors.get("lm_head.weight")
    rows = lm.shape[0] if lm is not None else loaded.config.draft_vocab_size
    if d2t is None:
        if rows != V:
            raise Eagle3InputError(f"{where}: no d2t tensor, but lm_head has {rows} rows for a {V}-token vocabulary: "
                                   f"without d2t nobody can tell which token each row predicts")
        notes.append("no d2t: the draft predicts the whole vocabulary (identity mapping)")
        return torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    name = loaded.source_name("d2t")
    if d2t.ndim != 1 or d2t.is_floating_point():
        raise Eagle3InputError(f"{where}: tensor '{name}' must be a 1-D integer tensor, got {d2t.dtype} "
                               f"{list(d2t.shape)}")
    d2t = d2t.long()
    if d2t.shape[0] != rows:
        raise Eagle3InputError(f"{where}: tensor '{name}' maps {d2t.shape[0]} draft rows, but lm_head has {rows} "
                               f"rows: the vocabulary mapping and the head disagree")
    targets = torch.arange(d2t.shape[0]) + d2t
    if targets.min() < 0 or targets.max() >= V:
        raise Eagle3InputError(f"{where}: tensor '{name}' maps draft rows to token ids outside [0, {V}) "
                               f"(range {int(targets.min())}..{int(targets.max())})")
    if torch.unique(targets).numel() != targets.numel():
        raise Eagle3InputError(f"{where}: tensor '{name}' maps several draft rows to the same token")
    expected = torch.zeros(V, dtype=torch.bool)
    expected[targets] = True
    if t2d is not None and not torch.equal(t2d.bool(), expected):
        _warn(notes, f"t2d of the source disagrees with its d2t ({int(t2d.bool().sum())} vs {d2t.shape[0]} tokens); "
                     f"using t2d rebuilt from d2t, which is what the engines serve with")
    return d2t, expected


def load_finetune_source(cfg, inputs, read_data: bool = True) -> FinetuneSource:
    """Read `cfg.finetune_from` in any layout and check it against the run's verifier and hidden states.
    `read_data=False` (dry run): big tensors stay meta (shapes and dtypes from the headers), files are not hashed."""
    if cfg.finetune_vocab not in VOCAB_POLICIES:
        raise Eagle3InputError(f"train.finetune_vocab must be one of {VOCAB_POLICIES}, got '{cfg.finetune_vocab}'")
    # a wrong verifier stops before reading GBs
    loaded = load_draft_source(cfg.finetune_from, shapes_only=True, aux_convention=cfg.source_aux_convention)
    summary = source_summary(loaded)
    H, V, L = verifier_dims(inputs.verifier.config)
    fill_default_aux_ids(loaded.config, L)
    # Hidden size and vocabulary: a draft made for another verifier stops here, with the tensor that shows it (its
    # layers are checked against the run's below, where --allow-aux-layer-mismatch may accept them).
    check_draft_fits_verifier(loaded.config, inputs.verifier.config, f"finetune source {loaded.path}",
                              inputs.verifier.name, {**loaded.tensors, **loaded.extra}, loaded.source_name,
                              draft_hidden=loaded.config.hidden_size, check_layers=False)
    notes: list[str] = []
    for n in loaded.notes:  # after the fit check: a wrong verifier gets its one message, not warnings first
        _warn(notes, n)
    aux = aux_layer_record(loaded, inputs, L, bool(getattr(cfg, "allow_aux_layer_mismatch", False)), notes)
    d2t, t2d = _source_vocab(loaded, V, notes)
    if read_data:
        loaded = load_tensor_data(loaded)
        check_finite(((loaded.source_name(k), t) for k, t in loaded.tensors.items()),
                     f"finetune source {loaded.path}", "a draft started from it trains to NaN: use an intact copy "
                     "of the source (re-download it) or another checkpoint")
    overrides = {f: getattr(loaded.config, f) for f in ARCH_FIELDS}
    if cfg.architecture != "llama" and cfg.architecture != overrides["architecture"]:
        # the layer kind is the source's: a run that asks for another one is a mistake, never a silent rebuild
        raise Eagle3InputError(f"train.architecture={cfg.architecture} but the finetune source {cfg.finetune_from} "
                               f"is a {overrides['architecture']} draft; drop the setting (a finetune keeps the "
                               f"source's layer kind)")
    if overrides["architecture"] != cfg.architecture:
        _warn(notes, f"train.architecture={cfg.architecture} replaced by the source's {overrides['architecture']}")
    for f in RUN_ARCH_SETTINGS:
        mine = getattr(cfg, f)
        if f in ("intermediate_size", "hidden_size") and mine is None:
            continue  # "the verifier's" - not a choice the user made
        if f == "hidden_size" and overrides["target_hidden_size"] is None and mine == H:
            continue  # the verifier's width, named
        if mine != overrides[f]:
            _warn(notes, f"train.{f}={mine} replaced by the source's {overrides[f]}")
    _method_overrides(cfg, loaded, overrides, notes)
    vocab = (d2t, t2d) if cfg.finetune_vocab == "keep" else None
    return FinetuneSource(loaded, overrides, vocab, d2t, t2d, summary, notes, aux)


def _method_overrides(cfg, loaded: LoadedDraft, overrides: dict[str, Any], notes: list[str]) -> None:
    """The draft method is the run's (train.method: an EAGLE-3 draft finetunes into P-EAGLE and back). A source of
    the same mask-token method keeps its mask token, with which its mask_hidden was learned."""
    source = loaded.config
    if source.method != cfg.method:
        notes.append(f"the source is a {source.method} draft, trained here as {cfg.method}: what only one of the two "
                     f"methods has ({', '.join(_method_only(source.method, cfg.method)) or 'nothing'}) is dropped "
                     f"or starts from a fresh initialisation")
    elif source.mask_token_id is not None:
        if cfg.mask_token_id is not None and cfg.mask_token_id != source.mask_token_id:
            _warn(notes, f"train.mask_token_id={cfg.mask_token_id} replaces the source's {source.mask_token_id}, with "
                         f"which its mask_hidden was learned")
        else:
            overrides["mask_token_id"] = source.mask_token_id


def _method_only(a: str, b: str) -> list[str]:
    """Tensors one of the two methods has and the other lacks."""
    mine, theirs = set(draft_method(a).parameters), set(draft_method(b).parameters)
    return sorted(mine ^ theirs)


def _check_built_for(model, source: FinetuneSource, policy: str, inputs) -> None:
    hint = "build it with build_model(cfg, inputs, overrides=source.draft_overrides, vocab=source.vocab)"
    for f, v in source.draft_overrides.items():
        if getattr(model.config, f) != v:
            raise Eagle3InputError(f"the draft was built with {f}={getattr(model.config, f)}, but the finetune source "
                                   f"has {v}: {hint}")
    want = source.d2t.shape[0] if policy == "keep" else inputs.d2t.shape[0]
    if model.config.draft_vocab_size != want:
        raise Eagle3InputError(f"the draft has {model.config.draft_vocab_size} draft-vocab rows, but finetune_vocab="
                               f"{policy} needs {want}: {hint}")


def _shape_error(loaded: LoadedDraft, wrong: list[tuple[str, tuple, tuple]]) -> Eagle3InputError:
    k, got, want = wrong[0]
    more = "".join(f"; '{loaded.source_name(k2)}' {list(g)} vs {list(w)}" for k2, g, w in wrong[1:6])
    return Eagle3InputError(
        f"finetune source {loaded.path}: tensor '{loaded.source_name(k)}' has shape {list(got)}, but the draft built "
        f"from the source's own config needs {list(want)}: its config.json does not describe its weights "
        f"(intermediate_size, heads, head_dim or draft_vocab_size differ) - the config was edited or belongs to "
        f"another draft{more}")


@torch.no_grad()
def _embed_difference(stored: torch.Tensor, verifier: torch.Tensor, chunk: int = 8192) -> float:
    worst = 0.0
    for s in range(0, stored.shape[0], chunk):
        d = (stored[s:s + chunk].float() - verifier[s:s + chunk].float()).abs()
        tol = 1e-3 + 1e-2 * verifier[s:s + chunk].float().abs()  # bf16/fp16 storage of the same values passes
        worst = max(worst, float((d - tol).clamp(min=0).max()))
    return worst


def _vocab_overlap(src_ids: torch.Tensor, run_ids: torch.Tensor) -> dict[str, Any]:
    shared = int(torch.isin(run_ids, src_ids).sum())
    return {"source_draft_vocab_size": int(src_ids.numel()), "run_draft_vocab_size": int(run_ids.numel()),
            "shared_tokens": shared, "share_of_source": round(shared / max(1, src_ids.numel()), 4),
            "share_of_run": round(shared / max(1, run_ids.numel()), 4)}


@torch.no_grad()
def _remap_lm_head(model, src_lm: torch.Tensor, src_ids: torch.Tensor, inputs, lm_head_init: str) -> None:
    """Rows of tokens in both vocabularies keep their trained row; new tokens start from the verifier's row."""
    run_ids = model.draft_token_ids().cpu()
    row_of = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    row_of[src_ids] = torch.arange(src_ids.numel())
    src_rows = row_of[run_ids]
    shared = src_rows >= 0
    w = model.lm_head.weight
    from_verifier = lm_head_init == "verifier" and not model.config.own_embedding  # same width only
    new = inputs.lm_head[run_ids].to(w) if from_verifier else w.detach().clone()
    new[shared] = src_lm[src_rows[shared]].to(w)
    w.copy_(new)


def apply_finetune_source(model, cfg, inputs, source: FinetuneSource | None = None,
                          copy: bool = True) -> dict[str, Any]:
    """Load the source's weights into `model` (built for this verifier) and return the run's `init` record.
    `copy=False` (dry run, meta model): every key, shape, dtype and vocab check, but no tensor data is touched."""
    source = source or load_finetune_source(cfg, inputs)
    loaded, policy = source.loaded, cfg.finetune_vocab
    notes = list(source.notes)
    _check_built_for(model, source, policy, inputs)
    state = model.state_dict()
    H = model.config.hidden_size
    wanted = {k: tuple(v.shape) for k, v in state.items() if k not in _NOT_LOADED + _VOCAB_KEYS}
    if policy == "rebuild":
        wanted["lm_head.weight"] = (source.d2t.shape[0], H)  # the source's rows, remapped below
    to_copy, ignored, unknown = _match_tensors(loaded, wanted, notes)
    # a method's own tensors (P-EAGLE's mask_hidden) across methods: dropped, or fresh (noted in the source notes)
    method_only = set(_method_only(loaded.config.method, model.config.method))
    ignored += sorted(k for k in unknown if k in method_only)
    unknown = [k for k in unknown if k not in method_only]
    wanted = {k: v for k, v in wanted.items() if k in to_copy or k not in method_only}
    embed = loaded.extra.get("embed_tokens.weight")
    if model.config.own_embedding:  # a draft of another width: its embedding is its own, loaded with its weights
        if embed is None:
            raise Eagle3InputError(f"finetune source {loaded.path}: a draft of width {H} needs its own "
                                   f"embed_tokens.weight (the verifier's has width {model.config.aux_hidden_size})")
        to_copy["embed_tokens.weight"] = embed
    elif embed is not None:
        ignored.append(loaded.source_name("embed_tokens.weight"))
        _note_embedding(embed, inputs, notes, copy)
    missing = sorted(set(wanted) - set(to_copy))
    ignored += _check_unknown_and_missing(loaded, unknown, missing, cfg.allow_missing, notes)
    overlap = _load_weights_and_vocab(model, to_copy, source, inputs, cfg, notes, copy)
    loaded_keys = sorted(to_copy) + (list(_VOCAB_KEYS) if policy == "keep" else [])
    shared = overlap["shared_tokens"]
    log.info("finetune: loaded %d tensors from %s (%s format); renamed %d, ignored %s, missing %s; vocab %s (%s)",
             len(loaded_keys), loaded.path, loaded.format, len(loaded.renamed), ignored, missing, policy,
             "no run vocab to compare" if shared is None else f"{shared} shared tokens")
    return {
        "method": "finetune",
        "source": str(cfg.finetune_from),
        "resolved": str(loaded.path.resolve()),
        "format": loaded.format,
        "weight_files": loaded.weight_files,
        "source_config_summary": source.summary,
        "source_metadata": loaded.metadata,
        "keys": {"loaded": loaded_keys, "renamed": dict(loaded.renamed), "ignored": ignored, "missing": missing},
        "vocab_policy": policy,
        "vocab_overlap": overlap,
        "allow_missing": bool(cfg.allow_missing),
        "aux_layers": source.aux_layers,
        "notes": notes,
    }


def _match_tensors(loaded, wanted: dict[str, tuple], notes: list[str]
                   ) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """(tensors to copy, source names ignored, source names this draft has no place for); a wanted tensor of
    another shape or a non-float one is an error."""
    to_copy: dict[str, torch.Tensor] = {}
    wrong: list[tuple[str, tuple, tuple]] = []
    ignored: list[str] = []
    unknown = list(loaded.unknown)
    for k, v in loaded.tensors.items():
        if k in _VOCAB_KEYS:
            continue
        if k in wanted and tuple(v.shape) == wanted[k] and not v.is_floating_point():
            raise Eagle3InputError(f"finetune source {loaded.path}: tensor '{loaded.source_name(k)}' is {v.dtype}, "
                                   f"but a weight must be floating point: the file is not an EAGLE-3 draft")
        if k in wanted and tuple(v.shape) == wanted[k]:
            to_copy[k] = v
        elif k in wanted:
            wrong.append((k, tuple(v.shape), wanted[k]))
        elif k.endswith("rotary_emb.inv_freq"):
            ignored.append(loaded.source_name(k))
            notes.append(f"{loaded.source_name(k)} ignored: RoPE frequencies are recomputed from rope_theta")
        else:
            unknown.append(loaded.source_name(k))
    if wrong:
        raise _shape_error(loaded, wrong)
    return to_copy, ignored, unknown


def _note_embedding(embed: torch.Tensor, inputs, notes: list[str], copy: bool) -> None:
    """The source's embedding is never loaded (the verifier's is used): note whether it was the same one."""
    diff = _embed_difference(embed, inputs.embed) if copy else None
    if diff is None:
        notes.append("the source's embed_tokens was not compared with the verifier's (dry run: no data read)")
    elif diff > 0:
        _warn(notes, f"the source's embed_tokens differs from verifier {inputs.verifier.name}'s (beyond storage "
                     f"rounding by {diff:.3g}): it was trained with another embedding; the verifier's is used")
    else:
        notes.append("the source's embed_tokens equals the verifier's (not loaded; the verifier's is used)")


def _check_unknown_and_missing(loaded, unknown: list[str], missing: list[str], allow_missing: bool,
                               notes: list[str]) -> list[str]:
    """Refuse source tensors without a place and draft tensors without a source, unless allow_missing; returns the
    source names then ignored."""
    ignored: list[str] = []
    if unknown:
        msg = (f"finetune source {loaded.path} holds tensors this draft has no place for: {sorted(unknown)} - they "
               f"belong to a layout or option we do not support, and dropping them would change the network")
        if not allow_missing:
            raise Eagle3InputError(msg + "; pass --allow-missing to ignore them (they are recorded)")
        _warn(notes, msg + "; ignored (allow_missing)")
        ignored += sorted(unknown)
    if missing:
        msg = f"finetune source {loaded.path} lacks trainable tensors of the draft: {missing}"
        if not allow_missing:
            raise Eagle3InputError(msg + "; pass --allow-missing to start them from a fresh initialisation")
        _warn(notes, msg + "; they start from a fresh initialisation (allow_missing)")
    return ignored


def _load_weights_and_vocab(model, to_copy: dict[str, torch.Tensor], source: FinetuneSource, inputs, cfg,
                            notes: list[str], copy: bool) -> dict[str, Any]:
    """Copy the matched tensors and set the draft vocabulary by the policy (keep the source's, or rebuild: the run's,
    with the shared tokens' lm_head rows remapped); returns the vocabulary overlap record."""
    params = dict(model.named_parameters())
    src_ids = torch.arange(source.d2t.shape[0]) + source.d2t
    run_ids = None if inputs.d2t is None else torch.arange(inputs.d2t.shape[0]) + inputs.d2t
    policy = cfg.finetune_vocab
    with torch.no_grad():
        for k, v in to_copy.items():
            if not copy or (k == "lm_head.weight" and policy == "rebuild"):
                continue
            params[k].copy_(v.to(params[k].dtype))  # cast to the built model's dtype
        if policy == "keep":
            model.set_vocab(source.d2t, source.t2d)
            if run_ids is None:
                overlap = {"source_draft_vocab_size": int(src_ids.numel()), "run_draft_vocab_size": None,
                           "shared_tokens": None}
                notes.append(f"vocab keep: the source's {src_ids.numel()}-token draft vocabulary is used (no run "
                             f"vocab given)")
            else:
                overlap = _vocab_overlap(src_ids, run_ids)
                notes.append(f"vocab keep: the source's {src_ids.numel()}-token draft vocabulary is used; the run's "
                             f"vocab {inputs.vocab_path} is not (its tokens overlap: {overlap['share_of_run']:.1%})")
                if overlap["share_of_run"] < KEEP_OVERLAP_WARN:
                    overlap["low_overlap_warning"] = True
                    _warn(notes, f"vocab keep: the source's draft vocabulary holds only {overlap['share_of_run']:.1%} "
                                 f"of the {overlap['run_draft_vocab_size']} tokens this run's data needs most: tokens "
                                 f"outside it can never be drafted; --finetune-vocab rebuild uses the run's vocab")
        else:
            model.set_vocab(inputs.d2t, inputs.t2d)
            if "lm_head.weight" in to_copy and copy:
                _remap_lm_head(model, to_copy["lm_head.weight"], src_ids, inputs, cfg.lm_head_init)
            overlap = _vocab_overlap(src_ids, run_ids)  # = the model's draft_token_ids()
            overlap["new_rows_from"] = "verifier lm_head" if cfg.lm_head_init == "verifier" else "random init"
            notes.append(f"vocab rebuild: {overlap['shared_tokens']} of {overlap['run_draft_vocab_size']} draft tokens "
                         f"keep their trained lm_head row ({overlap['share_of_run']:.1%}); the rest start from the "
                         f"{overlap['new_rows_from']}")
    return overlap


def finetune_model(cfg, inputs):
    """Read the source, build the draft with its architecture for this verifier, load it: (model, init record)."""
    from eagle3_train.train.build import build_model

    source = load_finetune_source(cfg, inputs)
    model = build_model(cfg, inputs, overrides=source.draft_overrides, vocab=source.vocab)
    return model, apply_finetune_source(model, cfg, inputs, source)
