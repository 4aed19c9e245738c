"""Training settings: one dataclass, the YAML section `train`, the flags of `eagle3-train train` and `train()`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal, get_args

from eagle3_train.model.draft_methods import NAMES as METHOD_NAMES
from eagle3_train.model.layer_kinds import NAMES
from eagle3_train.utils.io import Eagle3InputError
from eagle3_train.utils.settings import check_ranges, setting

# shared with extract's settings (settings.py)
HS_DIR_HELP = ("the directory the hidden-state servers write each request's states to (their --hidden-states-dir), as "
               "this machine sees it; the client reads and deletes files only there")

Loss = Literal["ce", "tv", "nla", "kl+tv", "kl+nla"]  # train/losses.py
ReportTo = Literal["tensorboard", "wandb", "mlflow", "trackio", "none"]  # train/trackers.py's TRACKERS, and none

# What may differ between an interrupted run and its resume: where things live (data identity is checked by hash),
# how often it logs/saves, and the device. Anything else (lr, epochs, steps, architecture, seed, ...) shapes the
# result: continuing under other values would silently mix two runs.
RESUME_MAY_CHANGE = frozenset({
    "prepared", "hidden_states", "vocab", "out", "verifier", "finetune_from", "allow_missing", "device", "log_every",
    "eval_every", "save_every", "checkpoint_every_minutes", "keep_last", "resume", "overwrite", "stop_after",
    "max_eval_batches", "tensorboard", "report_to", "allow_aux_layer_mismatch", "trust_remote_code",
    "dry_run", "endpoint", "served_model", "prefetch", "online_concurrency", "hidden_states_dir", "parallel",
    "offload_optimizer"})


# Options retired after they measured no gain (benchmarks/LOG.md, "Retired training options"), each with the value
# under which a run trained as this version trains: a YAML or --set key naming one is an error that says so (a flag:
# the stage's parser says it was retired), and a checkpoint whose settings hold one resumes only at that value.
RETIRED: dict[str, Any] = {
    "chain_mask": False, "feature_noise": 0.0, "final_norm_init": "ones", "layer_init": "random",
    "layer_init_index": -1, "layer_init_embed": "random", "target_temperature": 1.0, "freeze_lm_head": False,
    "feature_loss": 0.0, "equalise_features": False}
_LAYER_INIT_ONLY = ("layer_init_index", "layer_init_embed")  # read only under layer_init verifier
AuxConvention = Literal["auto", "sglang", "vllm"]
AUX_CONVENTION_HELP = ("how the finetune source's aux layer ids in eagle_config are meant: auto (by producer: "
                       "SpecForge/SGLang drafts and TorchSpec exports are told apart, and a source that cannot be "
                       "told is refused, naming both readings), sglang (output of layer i) or vllm (input of layer i)")


# per trainable parameter, replicated: fp32 weights, gradients and AdamW's two moments (Muon's one momentum on the
# matrices makes it ~12: the bound is kept, so `auto` shards a little early rather than late)
REPLICATED_STATE_BYTES = 16
AUTO_FSDP_SHARE = 0.5  # parallel auto shards once the replicated state would take over this share of a GPU


def refuse_muon_offload(optimizer: str, offload_optimizer: bool) -> None:
    """Muon's step gathers whole matrices over the GPUs' process group; offloaded states live on the CPU."""
    if offload_optimizer and optimizer == "muon":
        raise Eagle3InputError("train.offload_optimizer keeps the optimizer states on the CPU, where Muon's gather "
                               "of whole matrices would not run on the GPUs' process group: set train.optimizer "
                               "adamw with offload_optimizer")


def auto_parallel(world_size: int, trainable: int, device_bytes: float | None) -> str:
    """What `train.parallel: auto` means (the trainer and `plan` decide alike): fsdp on several ranks whose GPUs the
    replicated training state would fill past AUTO_FSDP_SHARE, else ddp."""
    if world_size > 1 and device_bytes and REPLICATED_STATE_BYTES * trainable > AUTO_FSDP_SHARE * device_bytes:
        return "fsdp"
    return "ddp"


@dataclass
class TrainConfig:
    SECTION: ClassVar[str] = "train"
    RETIRED: ClassVar[dict[str, Any]] = RETIRED
    prepared: str = setting("", "output directory of `eagle3-train prepare`", yaml=False)
    hidden_states: str = setting("", "output directory of `eagle3-train extract` (hybrid mode: where the first "
                                     "epoch's states are written; default OUT/hidden_states)", yaml=False)
    # where the hidden states come from
    hidden_states_mode: Literal["offline", "online", "hybrid"] = setting(
        "offline", "offline: read --hidden-states from disk; online: ask the hidden-state servers at --endpoint for "
                   "every batch, write nothing; hybrid: ask them in the first epoch, store the states as an "
                   "ordinary hidden-states dir and read that afterwards")
    endpoint: list[str] = setting(default_factory=list, help="online/hybrid: hidden-state server URL ending in /v1 "
                                  "(`eagle3-train serve --extract-hidden-states`); repeat to spread the load; in a "
                                  "run config without endpoints the run starts one with the serving section")
    served_model: str | None = setting(None, "online/hybrid: served model name (default: the only one served)")
    layer_ids: str | list[int] | None = setting(
        None, "online/hybrid: the three aux layers 'low,mid,high' (default 2,L//2,L-3; offline: the extract's)")
    hidden_states_dtype: Literal["bfloat16", "float16", "float32"] = setting(
        "bfloat16", "online/hybrid: dtype the fetched states are rounded to (as extract stores them)")
    prefetch: int = setting(2, "online/hybrid: batches requested ahead of use (at most this many wait in memory)",
                            valid=">= 0")
    online_concurrency: int = setting(8, "online/hybrid: requests in flight per rank over all endpoints", valid=">= 1")
    hidden_states_dir: str | None = setting(None, "online/hybrid: " + HS_DIR_HELP)
    vocab: str = setting("", "output directory of `eagle3-train vocab` (or a vocab.safetensors file)", yaml=False)
    out: str = setting("runs/train", "run directory: checkpoints/, final/, metrics.jsonl", yaml=False)
    verifier: str | None = setting(None, "verifier (default: the one recorded by extract)", yaml=False)
    # how the draft proposes (model/draft_methods.py)
    method: str = setting(
        "eagle3", "draft method: eagle3 (sequential: draft j reads the draft's own step j-1; vLLM and SGLang), "
                  "peagle (P-EAGLE, parallel drafting: drafts 2..k read a mask token and a learned mask_hidden, so "
                  "vLLM drafts all k in one forward, served with \"parallel_drafting\": true; vLLM only; trains "
                  "k = ttt_steps slots, serve at most that many) or dflash (DFlash: Qwen3 layers draft a block of "
                  "ttt_steps mask slots after the verified token in one non-causal forward over the verifier's "
                  "features; vLLM only, served with num_speculative_tokens = ttt_steps)", choices=METHOD_NAMES)
    mask_token_id: int | None = setting(
        None, "methods peagle, dflash: the verifier-vocabulary token of the mask slots (default: the tokenizer's mask "
              "token, else the first embedding row past the tokenizer's tokens, else its pad token, else eos)",
        valid=">= 0", experimental=True)
    # training-time test
    ttt_steps: int = setting(7, "training-time-test steps: the draft is unrolled this many times on its own "
                                "predictions", valid=">= 1")
    step_decay: float = setting(0.8, "loss weight of TTT step j is step_decay**j", valid="(0, 1]")
    supervise: Literal["assistant", "all"] = setting(
        "assistant", "training positions whose verifier distribution the draft fits: assistant (the prepared loss "
                     "mask, as in every EAGLE trainer) or all (every token of a row, prompts too: the target is the "
                     "verifier's distribution, which exists everywhere, so the same rows teach more); validation "
                     "always scores the assistant tokens")
    # optimisation
    epochs: float = setting(1.0, "passes over the training split (fractions allowed)", valid="> 0")
    max_steps: int | None = setting(None, "stop after this many optimizer steps (default: from epochs)", valid=">= 1")
    token_budget: int = setting(2048, "padded tokens per micro-batch", valid=">= 1")
    grad_accum: int = setting(1, "micro-batches per optimizer step", valid=">= 1")
    lr: float = setting(1e-4, "peak learning rate of both optimizer groups (muon_lr: the Muon group's), cosine "
                             "schedule; 0 checks a finetune loads unchanged",
                        valid=">= 0")
    warmup_ratio: float = setting(0.015, "share of the steps spent in linear warm-up", valid="[0, 1]")
    min_lr_ratio: float = setting(0.0, "final learning rate as a share of lr", valid="[0, 1]")
    weight_decay: float = setting(0.0, "AdamW weight decay", valid=">= 0")
    beta1: float = setting(0.9, "AdamW beta1", valid="[0, 1)")
    beta2: float = setting(0.95, "AdamW beta2", valid="[0, 1)")
    grad_clip: float = setting(0.5, "gradient norm clip (0: none)", valid=">= 0")
    noise: float = setting(0.0, "training only: uniform +-noise added to the aux features", valid=">= 0")
    checkpoint_loss: bool = setting(True, "recompute per-step logits in backward (less memory, one extra lm_head "
                                          "matmul)")
    checkpoint_mlp: bool = setting(True, "recompute each step's MLP in backward (less memory, two extra MLP "
                                         "matmuls)")
    seed: int = setting(0, "seed of initialisation and data order")
    device: str = setting("auto", "auto (cuda if available), cpu or cuda[:N]")
    precision: Literal["auto", "fp32", "bf16"] = setting(
        "auto", "fp32, or bf16 (autocast, fp32 master weights); auto = bf16 where the hardware has it natively (CUDA, "
        "CPUs with AVX512-BF16/AMX), else fp32")
    parallel: Literal["auto", "ddp", "fsdp"] = setting(
        "auto", "under torchrun: ddp (torch's DistributedDataParallel: every rank holds the whole draft and its "
        "optimizer states) or fsdp (FSDP2 fully_shard: weights, gradients and optimizer states divided over the ranks, "
        "each unit gathered for its compute, bf16 on the wire under bf16); auto = fsdp where the replicated "
        "training state would take over half a GPU, else ddp (`eagle3-train plan` shows both); a run resumes "
        "under either, on any number of processes dividing its micro-batches per step")
    offload_optimizer: bool = setting(False, "parallel fsdp: keep the sharded fp32 weights, gradients and optimizer "
                                             "states in CPU memory (FSDP2's CPUOffloadPolicy; the step runs on CPU; "
                                             "needs CUDA and train.optimizer adamw, not run by the tests)",
                                      experimental=True)
    release_host_memory: bool = setting(
        False, "CPU training on glibc: hand freed heap memory back to the OS after every step (malloc_trim), so "
        "batches of varying shape do not grow RSS over a long run")
    # draft architecture
    architecture: str = setting(
        "llama", "draft decoder layer: llama (grouped-query attention; vLLM and SGLang) or mla (DeepSeek-V3's latent "
        "attention with the verifier's MLA dims, as the Kimi-K2.5 MLA drafts; vLLM, beside an MLA verifier)",
        choices=NAMES)
    num_layers: int = setting(1, "draft decoder layers (SGLang's MLA loader builds only 1)", valid=">= 1")
    hidden_size: int | None = setting(
        None, "draft width below (or above) the verifier's, e.g. 2560 under 7168 (default: the verifier's): fc "
              "reads the verifier's width (target_hidden_size), the draft trains and ships its own embedding and "
              "starts its lm_head at random; a Llama layer keeps the verifier's head_dim", valid=">= 1",
        experimental=True)
    intermediate_size: int | None = setting(None, "draft MLP width (default: the verifier's)", valid=">= 1")
    norm_before_residual: bool = setting(False, "normalise the hidden state before the residual (vLLM; SGLang "
                                                "ignores it)")
    norm_before_fc: bool = setting(False, "one RMSNorm over the concatenated aux features before fc (vLLM, SGLang's "
                                          "Llama loader; not on MLA drafts)")
    fc_norm: bool = setting(False, "EAGLE 3.1: one RMSNorm per aux feature (chunk) before fc (vLLM, SGLang); with "
                                   "norm_output it served 0.13 lower under AdamW here and tied under Muon "
                                   "(benchmarks/README.md)")
    norm_output: bool = setting(False, "EAGLE 3.1: feed the draft's post-norm output hidden state back to the next "
                                       "step (vLLM, SGLang)")
    lm_head_init: Literal["verifier", "random"] = setting(
        "verifier", "start the draft lm_head from the verifier's rows of the draft vocabulary, or at random")
    # finetuning
    finetune_from: str | None = setting(None, "start from a published or earlier draft (dir, export or hub id)")
    source_aux_convention: AuxConvention = setting("auto", AUX_CONVENTION_HELP)
    finetune_vocab: Literal["keep", "rebuild"] = setting(
        "keep", "finetuning: keep the source draft's vocabulary, or use this run's --vocab")
    allow_missing: bool = setting(False, "finetune even when the source lacks trainable tensors (they start "
                                         "random)")
    allow_aux_layer_mismatch: bool = setting(
        False, "finetune even when the source's features came from other verifier layers than the run's hidden "
               "states (recorded in the training metadata)")
    trust_remote_code: bool = setting(False, "record that the verifier's own code is trusted (as for "
                                             "prepare/extract)", yaml=False)
    dry_run: bool = setting(False, "check everything at full size (verifier, data, vocab, finetune source, exports) "
                                   "without optimizer steps or weight data; writes OUT/training_metadata.dry-run.json",
                            yaml=False)
    # bookkeeping
    log_every: int = setting(10, "log training metrics every N steps", valid=">= 1")
    eval_every: int | None = setting(None, "validate every N steps (default: at the end of each epoch)", valid=">= 1")
    save_every: int | None = setting(None, "checkpoint every N steps (also at the end of each epoch)", valid=">= 1")
    checkpoint_every_minutes: float = setting(30.0, "also checkpoint once this long since the last one, so a killed "
                                                    "run loses at most this much (0: off)", valid=">= 0")
    early_stop: int | None = setting(None, "end training after N validations in a row without a better estimate "
                                           "(the run then finishes at that step; unset: train every epoch)",
                                     valid=">= 1")
    keep_last: int = setting(2, "step checkpoints kept (best/ and final/ are kept apart)", valid=">= 0")
    resume: bool = setting(False, "continue from the latest checkpoint in --out")
    overwrite: bool = setting(False, "set a finished or different run in --out aside (renamed OUT.previous-TIME) "
                                     "and start over", yaml=False)
    stop_after: int | None = setting(None, "end this invocation after N more optimizer steps (checkpointed; "
                                           "resume later)", valid=">= 1")
    max_eval_batches: int | None = setting(None, "validate on at most N batches", valid=">= 1")
    report_to: list[ReportTo] = setting(
        default_factory=lambda: ["tensorboard"],
        help="experiment trackers that receive the metrics besides OUT/metrics.jsonl (train/trackers.py): tensorboard "
             "(OUT/tensorboard), wandb (Weights & Biases; WANDB_MODE=offline logs without an account, under "
             "OUT/wandb unless WANDB_DIR is set), mlflow (a file store in OUT/mlruns unless MLFLOW_TRACKING_URI is "
             "set), trackio (its local database in TRACKIO_DIR, default ~/.cache/huggingface/trackio), or none; "
             "wandb, mlflow and trackio need `pip install -r requirements-trackers.txt` (or the extra "
             "eagle3-train[trackers]). Project (MLflow: experiment) and run are named after the run directory "
             "(WANDB_PROJECT, MLFLOW_EXPERIMENT_NAME override the project). Each receives the settings once, when "
             "its run starts; a resume continues the same W&B, MLflow and trackio run (ids kept in "
             "OUT/trackers.json), where what the interrupted invocation logged after its last checkpoint stays "
             "beside what is logged again")
    tensorboard: bool | None = setting(None, "shorthand for report_to: true adds tensorboard, false removes it, "
                                             "unset leaves report_to as it is")
    # experimental: kept for a rerun at GPU scale (measured on small CPU pools only; docs/CONFIG.md lists them apart)
    loss: Loss = setting("ce", "objective per step (train/losses.py): ce (soft cross-entropy) or the acceptance-aware "
                               "LK family tv, nla, kl+tv, kl+nla (arXiv 2602.23881); ce ties nla in vLLM here",
                         experimental=True)
    loss_mix: float = setting(0.5, "weight of the CE (KL) term in kl+tv / kl+nla; 1 = ce, 0 = the LK term alone",
                              valid="[0, 1]", experimental=True)
    optimizer: Literal["adamw", "muon"] = setting(
        "muon", "muon: torch.optim.Muon on the fc and decoder-layer matrices (update RMS matched to AdamW's, so lr "
                "carries over), AdamW on the lm_head and norms (train/optimizer.py), as speculators trains by "
                "default; adamw: AdamW on all. Muon served 1.489 vs 1.425 at equal data over 522 steps here, but "
                "learned less in a run of 46 steps (benchmarks/LOG.md): for a few dozen steps prefer adamw")
    muon_lr: float | None = setting(None, "optimizer muon: peak learning rate of the Muon group (default: lr)",
                                    valid=">= 0", experimental=True)
    muon_momentum: float = setting(0.95, "optimizer muon: Nesterov momentum of the Muon group", valid="[0, 1)",
                                   experimental=True)
    muon_weight_decay: float = setting(0.1, "optimizer muon: decoupled weight decay of the Muon group", valid=">= 0",
                                       experimental=True)

    def __post_init__(self) -> None:  # the Python API too: train(TrainConfig(lr=-1)) stops here
        check_ranges(self)
        self.trackers()
        refuse_muon_offload(self.optimizer, self.offload_optimizer)

    def trackers(self) -> list[str]:
        """The trackers this run reports to: report_to (none: no tracker) with the tensorboard shorthand applied."""
        names = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        bad = [n for n in names if n not in get_args(ReportTo)]
        if bad:
            raise Eagle3InputError(f"train.report_to must list some of {list(get_args(ReportTo))}, got {bad}")
        if "none" in names and len(set(names)) > 1:
            raise Eagle3InputError(f"train.report_to: 'none' means no tracker and cannot stand with others, "
                                   f"got {names}")
        chosen = [n for n in dict.fromkeys(names) if n != "none"]
        if self.tensorboard is True and "tensorboard" not in chosen:
            chosen.insert(0, "tensorboard")
        if self.tensorboard is False and "tensorboard" in chosen:
            chosen.remove("tensorboard")
        return chosen

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def resume_conflicts(self, previous: dict[str, Any]) -> list[str]:
        """Settings of a checkpoint's run (`previous`) that differ from ours in a way that changes the result."""
        now = self.to_dict()
        changed = [f"{k} {previous[k]!r} -> {now[k]!r}" for k in now
                   if k not in RESUME_MAY_CHANGE and k in previous and previous[k] != now[k]]
        return changed + [f"{k} {previous[k]!r}: a retired option (benchmarks/LOG.md, 'Retired training options'); "
                          f"this version trains only as with {v!r}" for k, v in RETIRED.items()
                          if k in previous and previous[k] != v
                          and not (k in _LAYER_INIT_ONLY and previous.get("layer_init") == "random")]

    def step_weights(self) -> list[float]:
        return [self.step_decay ** j for j in range(self.ttt_steps)]
