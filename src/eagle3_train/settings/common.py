"""What several stages' settings share: the value types of their choices and the constants written once."""

from __future__ import annotations

from typing import Literal

Dtype = Literal["bfloat16", "float16", "float32"]
StoreDtype = Literal["bfloat16", "float16", "float32", "float8_e4m3"]  # float8_e4m3: hidden_states/fp8.py
# auto: float32 on CPU, bfloat16 on CUDA; native: bfloat16 where the device computes it natively (CUDA, CPUs with
# AVX512-BF16 or AMX), else as auto (serving/vllm_options.resolve_dtype)
ServerDtype = Literal["auto", "native", "bfloat16", "float16", "float32"]
Overflow = Literal["truncate", "drop"]
Reasoning = Literal["keep", "strip", "disable"]
ReasoningPlacement = Literal["auto", "template", "inline", "drop"]  # see data/reasoning.py
ExportFormat = Literal["eagle", "speculators"]
Engine = Literal["vllm", "sglang"]  # serving engines a draft is checked against (model/engines.py)
ExtractBackend = Literal["hf", "vllm"]  # where hidden states come from (hidden_states/extract.py)

# Shared by several stages (one value, written once).
MAX_MODEL_LEN = 2048  # context of the vLLM servers this package starts on CPU (on CUDA: the model's own)
NUM_SPECULATIVE_TOKENS = 3  # draft tokens per speculation round (k)
MAX_TOKENS = 128  # new tokens per turn when measuring acceptance
CONCURRENCY = 8  # requests in flight against a server
EXTRACT_GPU_MEMORY_UTILIZATION = 0.3  # a hidden-state server leaves room for training (on CPU: the share of RAM)
VERIFIER_HELP = "verifier: embedded name (smollm2-135m-instruct), HF checkpoint dir, .gguf file or hub id"
SERVER_DTYPE_CHOICES = ("auto: float32 on CPU (bfloat16 for MLA verifiers), bfloat16 on CUDA; native: bfloat16 where "
                        "the CPU has AVX512-BF16 or AMX (extract 1.5x faster here), else as auto")
TRUST_HELP = "run code the verifier ships (e.g. Kimi's tokenizer/config classes); off by default, recorded"
VLLM_ARGS_HELP = ("extra vLLM server flags, passed through as given (e.g. --vllm-arg=--tensor-parallel-size=8 "
                  "or, in YAML, ['--tensor-parallel-size', '8']); each item is split like a shell would; a flag "
                  "given here replaces the one this tool would set")
SERVER_EAGER_HELP = "skip torch.compile/CUDA graphs: faster start, slower decode (auto: "
CONTEXT_HELP = "context length of the vLLM servers started here (default: 2048 on CPU, the model's own on CUDA)"
K_FLAGS = {"flag": "-k", "aliases": ("--num-speculative-tokens", "--speculative-tokens")}
