"""The draft's decoder-layer kinds as data, one entry each: what a config of that kind must hold, how it follows its
verifier, what the engines read (its `architectures` name and `model_type`, the SGLang loader that builds it) and what
they do not serve. Torch-free, so the settings, the config checks and the engine verdicts read it;
`model/architectures.py` adds each kind's torch modules. Nothing else names a kind.

- `llama`: grouped-query attention (`LlamaForCausalLMEagle3`, vLLM's llama_eagle3.py and SGLang's).
- `mla`: DeepSeek-V3's multi-head latent attention with a dense MLP (vLLM's deepseek_eagle3.py): the drafts vLLM
  recommends for Kimi-K2.5. vLLM picks its MLA path from the draft config's `model_type`: `kimi_k2` is in vLLM 0.32's
  MLA list (and maps to DeepseekV3Config); `deepseek_v3` is not usable on a draft there (vLLM rewrites it into its
  DeepSeek-MTP model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eagle3_train.utils.io import Eagle3InputError

MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
SGLANG_READ = "0.5.23 (PyPI wheel, 2026-10-30)"  # the release whose loaders the entries describe


@dataclass(frozen=True)
class SGLangLoader:
    """The SGLang EAGLE-3 loader that builds a kind, as its source reads a draft (python/sglang/srt/models/FILE)."""
    architecture: str  # its EntryClass: the `architectures` name that selects it
    file: str
    max_layers: int | None  # decoder layers it builds (None: any)
    applies: frozenset[str]  # options it reads and applies when true
    ignores: dict[str, str]  # option -> what it does instead
    aux_ids: str  # how it takes eagle_config's aux layer ids
    # its target model takes eagle_config's ids as inputs of layer i unless the first id is 1 (SGLang's DeepSeek
    # target from PR #25454, 0.5.13): ids written as outputs of layer i then land one layer early
    shifts_unless_first_is_one: bool = False


@dataclass(frozen=True)
class LayerKind:
    name: str
    eagle_class: str  # config.json "architectures" of the EAGLE format
    model_type: str
    speculators_format: bool  # the speculators format can describe it
    sglang: SGLangLoader
    describe: Callable[[dict[str, Any]], str]  # its attention in one phrase, from a config dict (plan, inspect)
    summary_fields: tuple[str, ...]  # the attention fields that describe it (metadata, inspect)
    also_read: tuple[str, ...] = ()  # other "architectures" names of this kind that published drafts carry
    marker: str | None = None  # a config field only this kind has (tells it from a config without architectures)
    dims: tuple[str, ...] = ()  # its own dims, the verifier's by default
    required_dims: tuple[str, ...] = ()  # of `dims`, those a config of this kind must hold
    keeps_verifier_heads: bool = False  # at another width than its verifier's (else heads follow the width)
    unserved_options: dict[str, str] = field(default_factory=dict)  # option -> why an engine would not serve it
    vllm_refused_model_types: dict[str, str] = field(default_factory=dict)  # published spelling -> what vLLM does
    vllm_needs: str | None = None  # what a vLLM release needs to serve it at all

    def check(self, cfg: Any) -> None:
        """A draft config of this kind holds what the kind needs and no option the engines would not serve."""
        for option, why in self.unserved_options.items():
            if getattr(cfg, option):
                raise Eagle3InputError(why)
        if any(getattr(cfg, d) is None for d in self.required_dims):
            raise Eagle3InputError(f"an {self.name} draft needs {', '.join(self.required_dims[:-1])} and "
                                   f"{self.required_dims[-1]} (from an MLA verifier's config, or given)")


def _describe_llama(d: dict[str, Any]) -> str:
    return f"{d['num_attention_heads']} heads / {d['num_key_value_heads']} kv heads x {d['head_dim']}"


def _describe_mla(d: dict[str, Any]) -> str:
    return (f"MLA {d['num_attention_heads']} heads (q_lora {d['q_lora_rank']}, kv_lora {d['kv_lora_rank']}, "
            f"qk {d['qk_nope_head_dim']}+{d['qk_rope_head_dim']}, v {d['v_head_dim']})")


LAYER_KINDS: dict[str, LayerKind] = {k.name: k for k in (
    LayerKind(
        "llama", "LlamaForCausalLMEagle3", "llama", speculators_format=True,
        sglang=SGLangLoader(
            "LlamaForCausalLMEagle3", "llama_eagle3.py", None,
            frozenset({"norm_before_fc", "fc_norm", "norm_output", "target_hidden_size"}),
            {"norm_before_residual": "implements false only (the residual is taken before hidden_norm)"},
            "eagle_config only, as outputs of layer i (its Llama/Qwen targets capture at layer i + 1)"),
        describe=_describe_llama, summary_fields=("num_attention_heads", "num_key_value_heads", "head_dim")),
    # Eagle3DeepseekV2ForCausalLM: the name both engines register (vLLM maps V3 to it too; SGLang's
    # kimi_k25_eagle3.py registers V2 only)
    LayerKind(
        "mla", "Eagle3DeepseekV2ForCausalLM", "kimi_k2", speculators_format=False,
        sglang=SGLangLoader(
            "Eagle3DeepseekV2ForCausalLM", "kimi_k25_eagle3.py", 1,
            frozenset({"fc_norm", "norm_output", "target_hidden_size"}),
            {"norm_before_residual": "implements false only",
             "norm_before_fc": "has no norm over the concatenated taps (an input_norm weight is skipped with a "
                               "warning)"},
            "eagle_config first; its DeepSeek target captures at layer i itself (inputs of layer i) unless the "
            "first id is 1, then at i + 1 (PR #25454, 0.5.13; 0.5.4.post3-0.5.12: always i + 1)",
            shifts_unless_first_is_one=True),
        describe=_describe_mla, summary_fields=("num_attention_heads", *MLA_DIMS),
        also_read=("Eagle3DeepseekV3ForCausalLM",), marker="kv_lora_rank", dims=MLA_DIMS,
        required_dims=("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
        keeps_verifier_heads=True,
        # vLLM's deepseek_eagle3.py (0.32) has fc_norm and norm_output but no norm over the concatenated taps: such
        # a draft would be served without the norm it was trained with
        unserved_options={"norm_before_fc": "norm_before_fc is not served on an MLA draft (vLLM's "
                                            "deepseek_eagle3.py has no norm over the concatenated aux states): use "
                                            "fc_norm (one norm per aux state), which it serves"},
        vllm_refused_model_types={
            "deepseek_v3": "model_type deepseek_v3: vLLM (0.32) rewrites a deepseek_v3 draft into its DeepSeek-MTP "
                           "model instead of deepseek_eagle3.py, so it does not serve it as an EAGLE-3 draft "
                           "(finetune and export it: the export writes kimi_k2, which vLLM serves as one)"},
        # vLLM takes the MLA path for a draft by its model_type (kimi_k2 here; deepseek_v3 becomes DeepSeek-MTP)
        vllm_needs="mla layer: deepseek_eagle3.py and kimi_k2 among the MLA model types (both in 0.32); on CPU builds "
                   "only beside an MLA verifier"),
)}
NAMES = tuple(LAYER_KINDS)


def layer_kind(name: str) -> LayerKind:
    if name not in LAYER_KINDS:
        raise Eagle3InputError(f"draft architecture must be {' or '.join(NAMES)}, got {name!r}")
    return LAYER_KINDS[name]


def architecture_from_config(config: dict[str, Any]) -> str:
    """The layer kind an exported draft's config.json describes (its `architectures`, else a field only one kind
    has)."""
    names = config.get("architectures") or []
    for kind in LAYER_KINDS.values():
        if kind.eagle_class in names or any(n in names for n in kind.also_read):
            return kind.name
    layer = config.get("transformer_layer_config") or config
    return next((k.name for k in LAYER_KINDS.values() if k.marker and layer.get(k.marker)), NAMES[0])
