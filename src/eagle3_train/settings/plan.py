"""`plan`'s settings: the run to estimate, in the training stage's own names and defaults (`--ttt-steps`, `--parallel`,
`--store-dtype float8_e4m3`, ...), so a plan reads like the run it plans."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from eagle3_train.settings.common import StoreDtype
from eagle3_train.settings.train import AUX_CONVENTION_HELP, AuxConvention, TrainConfig, refuse_muon_offload
from eagle3_train.utils.settings import check_ranges, choices, setting

_TRAIN = TrainConfig()


@dataclass
class PlanSettings:
    SECTION: ClassVar[str] = "plan"
    verifier: str = setting("", "the verifier's config.json, a directory holding one, an embedded name or a hub id "
                                "(only config.json is fetched)", required=True)
    samples: int = setting(0, "training samples", required=True, valid=">= 1")
    tokens_per_sample: int = setting(0, "tokens per sample (prompt and answer)", required=True, valid=">= 1")
    draft_vocab: int | None = setting(
        None, "draft vocabulary rows (default: the finetune source's, else 32000, vocab's default); given with "
              "--finetune-from, planned as `--finetune-vocab rebuild` at this size", valid=">= 1")
    ttt_steps: int = setting(_TRAIN.ttt_steps, "training-time-test steps (train.ttt_steps)", aliases=("--ttt",),
                             valid=">= 1")
    token_budget: int = setting(_TRAIN.token_budget, "padded tokens per micro-batch and rank (train.token_budget)",
                                valid=">= 1")
    grad_accum: int = setting(_TRAIN.grad_accum, "micro-batches per optimizer step (train.grad_accum)", valid=">= 1")
    epochs: float = setting(_TRAIN.epochs, "passes over the data (train.epochs)", valid="> 0")
    gpus: int = setting(1, "data-parallel ranks over all nodes (or --nodes with --gpus-per-node)", valid=">= 1")
    nodes: int = setting(1, "machines the ranks are spread over", valid=">= 1")
    gpus_per_node: int | None = setting(None, "ranks per node: --gpus = --nodes x this", valid=">= 1")
    parallel: Literal["auto", "ddp", "fsdp"] = setting(
        "auto", "train.parallel: ddp (replicated), fsdp (sharded) or auto (as the trainer decides)")
    optimizer: Literal["adamw", "muon"] = setting(
        _TRAIN.optimizer, "train.optimizer: its fp32 state (adamw 8 bytes per parameter, muon 4 per matrix element)")
    offload_optimizer: bool = setting(False, "train.offload_optimizer: fsdp's sharded states in host memory")
    gpu_memory_gb: float | None = setting(None, "GB per GPU", aliases=("--gpu-memory",), valid="> 0")
    disk_tb: float | None = setting(None, "TB free for hidden states", aliases=("--disk",), valid="> 0")
    dtype: StoreDtype = setting("bfloat16", "storage dtype of the hidden states (extract's --store-dtype)",
                                flag="--store-dtype", aliases=("--dtype",))
    precision: Literal["bf16", "fp32"] = setting(
        "bf16", "training compute: bf16 (autocast, fp32 master weights; GPU) or fp32 (the CPU default)")
    device: Literal["cuda", "cpu"] = setting(
        "cuda", "cuda: frozen tensors copied to the GPU; cpu: device and host memory are the same")
    supervised_fraction: float = setting(1.0, "share of tokens with a loss (assistant tokens; 1 = the worst case)",
                                         valid="(0, 1]")
    # the draft: the trainer's settings, and overrides of what from_verifier derives (e.g. a published draft)
    method: str = setting(_TRAIN.method, "train.method: how the draft proposes (P-EAGLE adds its mask_hidden, one "
                                         "vector of the aux width; the unrolled slots are --ttt-steps either way)",
                          choices=choices(TrainConfig, "method"))
    architecture: str = setting(_TRAIN.architecture, "draft decoder layer (train.architecture; the MLA dims: the "
                                                     "verifier's or the finetune source's)",
                                choices=choices(TrainConfig, "architecture"))
    mla_dims: dict[str, int | None] | None = setting(None, "a finetune source's MLA dims", cli=False)
    num_layers: int = setting(_TRAIN.num_layers, "draft decoder layers (train.num_layers)", valid=">= 1")
    intermediate_size: int | None = setting(None, "draft MLP width (default: the verifier's)", valid=">= 1")
    num_attention_heads: int | None = setting(None, "draft attention heads (default: the verifier's)",
                                              aliases=("--draft-heads",), valid=">= 1")
    num_key_value_heads: int | None = setting(None, "draft key-value heads (default: the verifier's)",
                                              aliases=("--draft-kv-heads",), valid=">= 1")
    head_dim: int | None = setting(None, "draft head width (default: the verifier's)", aliases=("--draft-head-dim",),
                                   valid=">= 1")
    checkpoint_mlp: bool = setting(_TRAIN.checkpoint_mlp, "train.checkpoint_mlp")
    checkpoint_loss: bool = setting(_TRAIN.checkpoint_loss, "train.checkpoint_loss")
    layer_ids: tuple[int, ...] | None = setting(None, "the verifier layers tapped (default: extract's)", cli=False)
    server_memory_gb: float | None = setting(
        None, "GB per training GPU that the verifier's vLLM server takes (hybrid/online; 0: it runs on other GPUs; "
              "default: unknown, and at least its weights spread over these GPUs when their size is known)",
        aliases=("--server-memory",), valid=">= 0")
    # throughputs in tokens/s over the whole run, measured (generate's probe, `extract --max-samples N`, a short
    # `train --max-steps N`) or given: they turn into time figures
    generate_tokens_per_s: float | None = setting(None, "regeneration throughput (tokens/s, whole run)", valid="> 0")
    generated_tokens_per_sample: int | None = setting(None, "answer tokens per sample (default: --tokens-per-sample)",
                                                      valid=">= 1")
    extract_tokens_per_s: float | None = setting(None, "hidden-state throughput (tokens/s, all servers; also the "
                                                       "server's rate in hybrid/online training)", valid="> 0")
    train_tokens_per_s: float | None = setting(None, "training throughput (tokens/s, all ranks)", valid="> 0")
    finetune_from: str | None = setting(None, "a draft to finetune (dir, export or hub id): its architecture, "
                                              "vocabulary size and layers are planned")
    source_aux_convention: AuxConvention = setting("auto", AUX_CONVENTION_HELP)

    def __post_init__(self) -> None:
        check_ranges(self, "plan settings")
        refuse_muon_offload(self.optimizer, self.offload_optimizer)  # as the trainer refuses it
        if self.gpus_per_node:
            self.gpus = self.nodes * self.gpus_per_node
