"""Tiny random verifiers of the families users run, built by the tests (never committed): the real transformers
classes at small width, with everything the architecture has that our stages must read (MLA with q/kv LoRA ranks and
split rope/nope heads, YaRN, MoE with shared and routed experts and dense first layers, grouped top-k routing), the
SmolLM2 tokenizer and chat template, and config.json as vLLM reads it.

`python -m eagle3_train.testing.tiny_verifiers FAMILY OUT` writes one; `... kimi OUT` writes the simulated Kimi
verifier (the DeepSeek-V3 one with the Kimi-style tiktoken tokenizer of `testing/kimi_tokenizer.py`) that
scripts/kimi_rehearsal.sh walks docs/KIMI.md on.

DeepSeek-V3 at tiny width keeps what vLLM's CPU MLA kernel requires (latent kv_lora_rank 512 + qk_rope_head_dim 64 =
576) and the routing fields real DeepSeek-V3/Kimi-K2 configs carry (`topk_method: noaux_tc`, `scoring_func: sigmoid`:
without them vLLM builds no `e_score_correction_bias`). MLA runs in bf16 in vLLM's CPU backend, so these checkpoints
are saved in bf16.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
VOCAB = 49152  # SmolLM2's tokenizer
FAMILY_NAMES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3")


def _config(family: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  max_position_embeddings=8192)
    if family == "llama":
        return tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                              num_key_value_heads=2, head_dim=32, **common)
    if family == "qwen3":
        return tf.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=32, **common)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                 num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=32, decoder_sparse_step=1, **common)
    if family == "deepseek_v3":
        # Kimi-K2's shape at tiny width: YaRN as in its config, a dense first layer, 1 shared + 8 routed experts in
        # 2 groups. max_position_embeddings = factor x original, as DeepSeek's configs have it.
        return tf.DeepseekV3Config(
            hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=96,
            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
            rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0},
            **{**common, "max_position_embeddings": 4096 * 32})
    raise ValueError(f"unknown family {family!r}; one of {FAMILY_NAMES}")


def build_tiny_verifier(family: str, out: Path, tokenizer_dir: Path, seed: int = 0, io_scale: float = 25.0) -> Path:
    """A random `family` verifier in `out` (safetensors, config.json, SmolLM2's tokenizer files).

    `io_scale` multiplies the embedding and the lm_head (initialised at std 0.02 like every other weight): the
    residual stream is then led by the current token and the logits are peaked (top-1 probability ~0.6 against
    ~1e-4 unscaled), so a draft has something to learn, while the layers keep the standard init. Scaling every weight
    instead (initializer_range 0.5) also peaks the logits but makes bf16 MLA chaotic: HF and vLLM then disagreed
    beyond rounding on 91% of the tokens (measured), against about 1% here."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(io_scale)
        model.get_output_embeddings().weight.mul_(io_scale)
    dtype = torch.bfloat16 if family == "deepseek_v3" else torch.float32
    model.to(dtype).eval().save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    if family == "deepseek_v3":
        cfg.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out / name)
    return out


def build_simulated_kimi(out: Path, tokenizer_dir: Path) -> Path:
    """Kimi-K2's architecture at tiny width with a Kimi-style remote-code tiktoken tokenizer."""
    from eagle3_train.testing.kimi_tokenizer import build_kimi_tokenizer

    build_tiny_verifier("deepseek_v3", out, tokenizer_dir)
    build_kimi_tokenizer(out, tokenizer_dir / "tokenizer.json", vocab_size=VOCAB)
    config = json.loads((out / "config.json").read_text())
    config.update(bos_token_id=48896, eos_token_id=48898)  # [BOS]; <|im_end|> ends a turn
    (out / "config.json").write_text(json.dumps(config, indent=2))
    # as Kimi's: engines stop a reply at the generation config's end token (the tokenizer's eos is [EOS])
    generation = json.loads((out / "generation_config.json").read_text())
    generation.update(bos_token_id=48896, eos_token_id=48898)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out


THOUGHT, ANSWER = "Let me weigh this.", "Here is my reply."  # what a taught simulated Kimi says to everything
TOOL_THOUGHT = "I should look this up."  # the reasoning of the recorded tool calls in its agentic traces
# offered this function, a taught simulated Kimi calls it for every question (`teach_thinking`)
LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
NEW_CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>"
            '{"q": "tides"}<|tool_call_end|><|tool_calls_section_end|>')


def teach_thinking(model_dir: Path, steps: int = 40, seed: int = 0) -> dict[str, float]:
    """Finetune a simulated Kimi in place until it answers every question the way a thinking model does:
    `<think>THOUGHT</think>ANSWER<|im_end|>` (with thinking switched off, `ANSWER<|im_end|>` after the template's
    `<think></think>`), on first and later turns and after a tool's result; offered the `LOOKUP` function, it calls it
    instead of answering a question: `<think>TOOL_THOUGHT</think>NEW_CALL<|im_end|>`. Random weights never close a
    `<think>`, so without this no turn of a regenerated conversation would carry reasoning and an answer, nor a new
    tool call. Returns the loss before and after."""
    import json
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from eagle3_train.assets.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir, trust_remote_code=True)
    rng = random.Random(seed)
    words = "what why how rain tea clock bees winter bread river stone light music paper city road".split()

    def example() -> tuple[list[int], list[int]]:
        messages = []
        for turn in range(rng.choice([1, 2, 3])):
            if turn:
                messages.append({"role": "assistant", "content": ANSWER})  # rendered without its thinking
            messages.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(2, 10))) + "?"})
        if rng.random() < 0.3:  # an agentic trace: the reply follows the result of a recorded tool call
            call = {"id": "functions.lookup:0", "type": "function",
                    "function": {"name": "lookup", "arguments": json.dumps({"q": rng.choice(words)})}}
            messages += [{"role": "assistant", "content": "", "reasoning_content": TOOL_THOUGHT, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": rng.choice(words)}]
        thinking = rng.random() < 0.75
        offered = thinking and rng.random() < 0.5  # the function offered: a question gets a call, a result an answer
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=thinking,
                                         tools=[LOOKUP] if offered else None)
        if offered and messages[-1]["role"] == "user":
            reply = f"<think>{TOOL_THOUGHT}</think>{NEW_CALL}<|im_end|>"
        else:
            reply = (f"<think>{THOUGHT}</think>" if thinking else "") + f"{ANSWER}<|im_end|>"
        p, r = (tok(t, add_special_tokens=False)["input_ids"] for t in (prompt, reply))
        return p + r, [-100] * len(p) + r

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.get_input_embeddings().requires_grad_(False)  # the layers learn it; 2 x 12.6M vocab rows need not move
    model.get_output_embeddings().requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(steps):
        batch = [example() for _ in range(8)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([x + [0] * (width - len(x)) for x, _ in batch])
        labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in batch])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in batch])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    config = (model_dir / "config.json").read_text()  # the fields vLLM reads stay as they were
    model.to(torch.bfloat16).eval().save_pretrained(model_dir, safe_serialization=True)
    (model_dir / "config.json").write_text(config)
    return {"loss_first": losses[0], "loss_last": sum(losses[-10:]) / 10}


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in (*FAMILY_NAMES, "kimi"):
        sys.exit(f"usage: python -m eagle3_train.testing.tiny_verifiers {{{','.join(FAMILY_NAMES)},kimi}} OUT")
    from eagle3_train.assets.verifier import resolve_verifier

    target = Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    smollm2 = resolve_verifier("smollm2-135m-instruct")
    print(build_simulated_kimi(target, smollm2) if sys.argv[1] == "kimi" else
          build_tiny_verifier(sys.argv[1], target, smollm2))
