"""Header-only stand-ins of the named recipes' verifiers (configs/llama8b-8gpu.yaml,
configs/qwen3-8b-thinking-8gpu.yaml): each model's config.json with its published field values, its tokenizer files'
layout and a sharded checkpoint named by its index whose shards hold only the tensors a dry run reads (embedding,
final norm, lm_head, at full size: zeros in sparse files, so a 1.2 GB lm_head costs a few kB of disk). Kimi-K2.5's
stand-in is `support.kimi_layouts`.

The tokenizer files are the published layout, not the published text: tokenizer_config.json holds the family's
special tokens at their published ids and a short chat template written here with the family's turn markers (Qwen3's
reads `enable_thinking`, as the real one does: that is how `generate` recognises the thinking style);
generation_config.json holds the published sampling defaults. The vocabulary file (tokenizer.json, 9-11 MB) is left
out: a dry run reads no tokenizer (prepare's job, done with the real files).

`write_stage_outputs` writes what prepare, vocab and extract leave in a run directory (a few short samples, real
hidden states at the verifier's width, written with extract's own shard writer), so that `run --dry-run` goes on to
`train --dry-run` and builds the recipe's draft at full size.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3_train.assets.families import text_config
from eagle3_train.assets.verifier import verifier_identity
from eagle3_train.hidden_states.store import FORMAT, FORMAT_VERSION, ShardPlan, split_index, write_shard
from eagle3_train.train.dry_run import write_header_only_safetensors
from eagle3_train.utils.io import sha256_file, write_json
from support.draft_layouts import random_token_ids, vocab_from_ids

# meta-llama/Llama-3.1-8B-Instruct's config.json (its field values as published).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.42.3",
    "use_cache": True, "vocab_size": 128256}

# Qwen/Qwen3-8B's config.json (its field values as published).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}

# Special tokens at their published ids; the templates below use only these markers.
_LLAMA_SPECIAL = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128006: "<|start_header_id|>",
                  128007: "<|end_header_id|>", 128008: "<|eom_id|>", 128009: "<|eot_id|>"}
_QWEN3_SPECIAL = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151657: "<tool_call>",
                  151658: "</tool_call>", 151667: "<think>", 151668: "</think>"}

_LLAMA_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}")
_QWEN3_TEMPLATE = (
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{%- if m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{%- endif %}"
    "{{ m['content'] }}<|im_end|>\n{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}")


def _tokenizer_files(d: Path, special: dict[int, str], template: str, tokens: dict, generation: dict,
                     model_max_length: int) -> None:
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, t in special.items()}
    write_json(d / "tokenizer_config.json", {"added_tokens_decoder": added, "chat_template": template,
                                             "clean_up_tokenization_spaces": False,
                                             "model_max_length": model_max_length, **tokens})
    write_json(d / "special_tokens_map.json", {k: v for k, v in tokens.items() if k.endswith("_token")})
    write_json(d / "generation_config.json", generation)


def _sharded_checkpoint(d: Path, config: dict, shards: int, total_size: int) -> None:
    """`shards` header-only safetensors named as the published ones, the embedding in the first and the final norm
    and lm_head in the last (the shards between hold one layer norm each, so every file of the index exists)."""
    V, H, L = config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]
    bf16 = torch.bfloat16
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    specs: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {n: {} for n in names}
    specs[names[0]]["model.embed_tokens.weight"] = ((V, H), bf16)
    for i, name in enumerate(names[1:-1], start=1):
        specs[name][f"model.layers.{i * L // shards}.input_layernorm.weight"] = ((H,), bf16)
    specs[names[-1]].update({"model.norm.weight": ((H,), bf16), "lm_head.weight": ((V, H), bf16)})
    weight_map = {}
    for name, tensors in specs.items():
        write_header_only_safetensors(d / name, tensors, {})
        weight_map.update(dict.fromkeys(tensors, name))
    write_json(d / "model.safetensors.index.json", {"metadata": {"total_size": total_size}, "weight_map": weight_map})


def write_llama31_8b(d: Path) -> Path:
    """meta-llama/Llama-3.1-8B-Instruct: config, tokenizer layout, 4 header-only shards (16.06 GB as published)."""
    d.mkdir(parents=True, exist_ok=True)
    write_json(d / "config.json", LLAMA31_8B)
    _tokenizer_files(d, _LLAMA_SPECIAL, _LLAMA_TEMPLATE,
                     {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                      "tokenizer_class": "PreTrainedTokenizerFast"},
                     {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "do_sample": True,
                      "temperature": 0.6, "top_p": 0.9}, 131072)
    _sharded_checkpoint(d, LLAMA31_8B, 4, 16_060_522_496)
    return d


def write_qwen3_8b(d: Path) -> Path:
    """Qwen/Qwen3-8B: config, tokenizer layout (a template that reads `enable_thinking`), 5 header-only shards
    (8.19B parameters in bf16)."""
    d.mkdir(parents=True, exist_ok=True)
    write_json(d / "config.json", QWEN3_8B)
    _tokenizer_files(d, _QWEN3_SPECIAL, _QWEN3_TEMPLATE,
                     {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "tokenizer_class": "Qwen2Tokenizer"},
                     {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                      "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}, 131072)
    _sharded_checkpoint(d, QWEN3_8B, 5, 16_381_470_720)
    return d


def write_stage_outputs(run_dir: Path, verifier: Path, layer_ids: tuple[int, ...], draft_vocab: int = 32000,
                        samples: int = 4, length: int = 24, hidden_dir: str = "hidden_states",
                        record_done: bool = True, source: str = "stand-in samples") -> dict[str, Path]:
    """What prepare, vocab and extract leave in `run_dir` for `verifier`: prepared/ (a DatasetDict of random ids),
    vocab/vocab.safetensors and `hidden_dir`/ (real bf16 hidden states at the verifier's width, written with
    extract's own shard writer), and with `record_done` the pipeline's record of those stages, so that
    `run --dry-run` runs `train --dry-run` on them. Returns the three paths."""
    from datasets import Dataset, DatasetDict

    config = text_config(json.loads((verifier / "config.json").read_text()))
    V, H, L = config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]
    g = torch.Generator().manual_seed(0)
    prepared = run_dir / "prepared"
    rows = {s: [torch.randint(0, V, (length + i,), generator=g).tolist() for i in range(n)]
            for s, n in (("train", samples), ("validation", 2))}
    DatasetDict({s: Dataset.from_dict({
        "id": [f"{s}-{i}" for i in range(len(r))], "input_ids": r,
        "loss_mask": [[0] * 4 + [1] * (len(x) - 4) for x in r], "length": [len(x) for x in r]})
        for s, r in rows.items()}).save_to_disk(str(prepared / "dataset"))
    write_json(prepared / "manifest.json", {"stage": "prepare", "source": source,
                                            "counts": {s: len(r) for s, r in rows.items()}})
    vocab = run_dir / "vocab"
    vocab.mkdir(parents=True)
    d2t, t2d = vocab_from_ids(random_token_ids(draft_vocab, seed=12, vocab_size=V), V)
    save_file({"d2t": d2t, "t2d": t2d}, str(vocab / "vocab.safetensors"))

    hidden = run_dir / hidden_dir
    manifest = {"stage": "extract", "format": FORMAT, "format_version": FORMAT_VERSION, "status": "complete",
                "verifier": verifier_identity(verifier, hash_weights=False), "verifier_name": str(verifier),
                "layer_ids": list(layer_ids), "dtype": "bfloat16", "hidden_size": H, "num_layers": L,
                "prepared_manifest_sha256": sha256_file(prepared / "manifest.json"), "splits": {}}
    total = 0
    for split, r in rows.items():
        (hidden / split).mkdir(parents=True)
        plan = ShardPlan(0, tuple(range(len(r))), tuple(len(x) for x in r))
        aux = torch.randn(plan.num_tokens, 3 * H, generator=g).to(torch.bfloat16)
        final = torch.randn(plan.num_tokens, H, generator=g).to(torch.bfloat16)
        entry = write_shard(hidden / split / "shard-00000.safetensors", aux, final, plan, {"format": FORMAT})
        write_json(hidden / split / "index.json", split_index(split, [plan], {0: entry}))
        manifest["splits"][split] = {"num_samples": len(r), "num_tokens": plan.num_tokens, "num_shards": 1,
                                     "bytes": entry["bytes"], "complete": True}
        total += entry["bytes"]
    manifest["counts"] = {"samples": sum(len(r) for r in rows.values()),
                          "tokens": sum(len(x) for r in rows.values() for x in r), "bytes": total}
    write_json(hidden / "manifest.json", manifest)
    # recorded as done (with other settings: the plan says "done, but would run again", and the train dry run
    # reads the outputs that are there)
    if record_done:
        write_json(run_dir / "pipeline_state.json", {"stages": {s: {} for s in ("prepare", "vocab", "extract")}})
    return {"prepared": prepared, "vocab": vocab, "hidden": hidden}
