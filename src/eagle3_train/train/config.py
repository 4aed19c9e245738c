"""Training settings (one dataclass; YAML section `train`, CLI flags override)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# What may differ between an interrupted run and its resume: where things live (data identity is checked by hash),
# how often it logs/saves, and the device. Anything else (lr, epochs, steps, architecture, seed, ...) shapes the
# result: continuing under other values would silently mix two runs.
RESUME_MAY_CHANGE = frozenset({
    "prepared", "hidden_states", "vocab", "out", "verifier", "finetune_from", "allow_missing", "device", "log_every",
    "eval_every", "save_every", "keep_last", "resume", "stop_after", "max_eval_batches", "tensorboard"})


@dataclass
class TrainConfig:
    prepared: str = ""  # prepare's output dir
    hidden_states: str = ""  # extract's output dir
    vocab: str = ""  # vocab's output dir (or a vocab.safetensors file)
    out: str = "runs/train"
    verifier: str | None = None  # default: the verifier recorded by extract
    # training-time test
    ttt_steps: int = 7
    step_decay: float = 0.8  # step j weighs step_decay**j
    # objective per step (train/losses.py): ce | tv | nla | kl+tv | kl+nla (LK losses, arXiv 2602.23881)
    loss: str = "ce"
    loss_mix: float = 0.5  # weight of the CE (KL) term in kl+tv / kl+nla; 1 = ce, 0 = the LK term alone
    # optimisation
    epochs: float = 1.0
    max_steps: int | None = None
    token_budget: int = 2048  # padded tokens per micro-batch
    grad_accum: int = 1
    lr: float = 1e-4
    warmup_ratio: float = 0.015
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 0.5
    noise: float = 0.0  # uniform +-noise on the aux features
    checkpoint_loss: bool = True  # recompute per-step logits in backward (less memory, one extra lm_head matmul)
    checkpoint_mlp: bool = True  # recompute each step's MLP in backward (less memory, two extra MLP matmuls)
    seed: int = 0
    device: str = "auto"
    precision: str = "auto"  # fp32 | bf16 (autocast, fp32 master weights); auto = bf16 on CUDA, fp32 on CPU
    # draft architecture
    num_layers: int = 1
    intermediate_size: int | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    lm_head_init: str = "verifier"  # verifier rows of the draft vocab | random
    freeze_lm_head: bool = False
    # finetuning (issue: finetune from published drafts)
    finetune_from: str | None = None
    finetune_vocab: str = "keep"  # keep | rebuild
    allow_missing: bool = False
    # bookkeeping
    log_every: int = 10
    eval_every: int | None = None  # steps; default: end of each epoch
    save_every: int | None = None  # steps; checkpoints are also written at the end of each epoch
    keep_last: int = 2
    resume: bool = False
    stop_after: int | None = None  # end this invocation after N more optimizer steps (checkpointed; resume later)
    max_eval_batches: int | None = None
    tensorboard: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def resume_conflicts(self, previous: dict[str, Any]) -> list[str]:
        """Settings of a checkpoint's run (`previous`) that differ from ours in a way that changes the result."""
        now = self.to_dict()
        return [f"{k} {previous[k]!r} -> {now[k]!r}" for k in now
                if k not in RESUME_MAY_CHANGE and k in previous and previous[k] != now[k]]

    def step_weights(self) -> list[float]:
        return [self.step_decay ** j for j in range(self.ttt_steps)]
