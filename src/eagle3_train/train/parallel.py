"""Data parallelism for training: one process, torch's DistributedDataParallel, or FSDP2 (`fully_shard`), chosen by
`train.parallel`, behind one interface (`Engine`). The trainer calls the wrapped module's forward (one TTT unroll of
one micro-batch, `TTTModule`), `sync(last)` around each micro-batch's backward, `clip_grad_norm`, and the state-dict
calls checkpoints need; nothing else in the trainer knows which engine runs.

- ddp: every rank holds the whole draft, its fp32 master weights, gradients and optimizer states; gradients are reduced
  in buckets overlapped with the backward, once per optimizer step (`no_sync` on the other micro-batches).
- fsdp: the decoder layer(s), fc and the rest (the draft lm_head, norms, an own embedding) are sharded units
  (`fully_shard`): parameters, gradients and optimizer states are divided over the ranks; each unit is all-gathered
  for its compute (bf16 on the wire under bf16, fp32 reduce-scatter). The lm_head is in the root unit: the loss calls
  it once per piece of rows (train/ttt.py), a number that differs between ranks, and a unit of its own would
  reduce-scatter once per call. The frozen verifier embedding stays whole on every rank (`ignored_params`),
  in the compute dtype, as the verifier's lm_head (held outside the draft). Muon needs whole matrices: refused.

Gradients are summed over ranks (the loss is already normalised by the global supervised counts, so one process with
grad_accum x world_size micro-batches computes the same step): both engines average, so the loss is scaled by the
world size before backward (exact for power-of-two worlds).

Optimizer states are checkpointed with torch.distributed.checkpoint (`optimizer/`, one file per rank, resharded on
load), so a run resumes on another number of processes; the weights are gathered to rank 0 and written whole
(`model.safetensors`), so export, inspect, evaluate and finetune read every checkpoint as before.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.settings.train import auto_parallel
from eagle3_train.train.method_objectives import method_forward
from eagle3_train.train.objective import Objective
from eagle3_train.utils.distributed import DistInfo, broadcast_parameters
from eagle3_train.utils.io import Eagle3InputError

log = logging.getLogger(__name__)

ENGINES = ("auto", "ddp", "fsdp")
OPTIMIZER_DIR = "optimizer"  # the sharded optimizer state inside a checkpoint (torch.distributed.checkpoint)
_PREFIX = "draft."  # TTTModule's name for the draft: stripped from and added to state-dict keys


class TTTModule(nn.Module):
    """The draft with one forward: the training-time-test loss of one micro-batch. DDP and FSDP hook a module's
    forward, so the whole unroll goes through it."""

    def __init__(self, draft: Eagle3Draft, objective: Objective):
        super().__init__()
        self.draft = draft
        self.objective = objective

    def forward(self, batch, targets, denominators: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return method_forward(self.draft, batch, targets, self.objective, denominators)


def choose_engine(setting: str, info: DistInfo, device: torch.device, trainable: int) -> str:
    """`train.parallel` resolved; auto: `auto_parallel` on this GPU's memory (ddp on CPU)."""
    if setting not in ENGINES:
        raise Eagle3InputError(f"train.parallel must be one of {', '.join(ENGINES)}, got {setting!r}")
    if setting != "auto":
        return setting
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return auto_parallel(info.world_size, trainable, total)


@contextlib.contextmanager
def _one_process_quietly():
    """torch.distributed.checkpoint warns that it assumes one process when there is no process group: so it is."""
    import warnings

    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class Engine:
    """One process (world size 1, any `train.parallel`): the module as it is."""
    name = "single"
    sharded = False  # parameters are DTensor shards (FSDP): state dicts go through torch's collective helpers

    def __init__(self, module: TTTModule, info: DistInfo, device: torch.device):
        self.info, self.device = info, device
        self.module: nn.Module = module
        self.draft = module.draft
        self.loss_scale = float(info.world_size)  # engines average gradients over ranks; we sum

    def sync(self, last: bool):
        """Context of one micro-batch's forward and backward: gradients are reduced over ranks on the `last`."""
        return contextlib.nullcontext()

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def clip_grad_norm(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP: a DTensor partial over the shards
            norm = norm.full_tensor()
        return float(norm)

    # --- checkpoints ---------------------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The draft's trainable weights and buffers, whole, on CPU: on rank 0 (None on the others; a collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not self.sharded:  # every rank holds the same whole weights
            return self.draft.trainable_state_dict() if self.info.is_main else None
        sd = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                         ignore_frozen_params=True))
        if not self.info.is_main:
            return None
        sd = {k.removeprefix(_PREFIX): v for k, v in sd.items()}
        buffers = {k: v for k, v in self.draft.trainable_state_dict().items() if k not in sd}  # d2t, t2d
        return {**sd, **{k: v.cpu() for k, v in buffers.items()}}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load whole weights (every rank holds them) into the possibly sharded draft."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if not self.sharded:
            self.draft.load_state_dict(state, strict=False)
            return
        set_model_state_dict(self.module, {_PREFIX + k: v for k, v in state.items()},
                             options=StateDictOptions(full_state_dict=True, strict=False))

    def optimizer_state_dict(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        """The optimizers' states keyed by parameter name (each rank its shard under FSDP; a collective)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, optimizers)

    def save_optimizer(self, directory: Path | None, state: dict[str, Any]) -> None:
        """Every rank writes its part of `state` into `directory`/optimizer; rank 0 names the directory (its temp
        checkpoint), the others pass None and learn it from rank 0."""
        import torch.distributed.checkpoint as dcp

        path = [str(directory) if directory is not None else None]
        if self.info.world_size > 1:
            dist.broadcast_object_list(path, src=0)
        with _one_process_quietly():
            dcp.save({"optimizer": state}, checkpoint_id=Path(path[0]) / OPTIMIZER_DIR,
                     no_dist=not dist.is_initialized())
        if self.info.world_size > 1:
            dist.barrier()

    def load_optimizer(self, directory: Path, optimizers: list[torch.optim.Optimizer]) -> None:
        """Read `directory`/optimizer into the optimizers, resharded to this run's ranks."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        state = {"optimizer": self.optimizer_state_dict(optimizers)}
        with _one_process_quietly():
            dcp.load(state, checkpoint_id=directory / OPTIMIZER_DIR, no_dist=not dist.is_initialized())
        set_optimizer_state_dict(self.module, optimizers, state["optimizer"])


class DDPEngine(Engine):
    name = "ddp"

    def __init__(self, module: TTTModule, info: DistInfo, device: torch.device):
        super().__init__(module, info, device)
        # DDP broadcasts rank 0's parameters and buffers here; the buffers (vocab maps, RoPE) never change after
        self.module = nn.parallel.DistributedDataParallel(
            module, device_ids=[device] if device.type == "cuda" else None, broadcast_buffers=False,
            gradient_as_bucket_view=True)

    def sync(self, last: bool):
        return contextlib.nullcontext() if last else self.module.no_sync()


class FSDPEngine(Engine):
    name = "fsdp"
    sharded = True

    def __init__(self, module: TTTModule, info: DistInfo, device: torch.device, precision: str,
                 offload_optimizer: bool = False):
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )

        super().__init__(module, info, device)
        broadcast_parameters(module, info)  # fully_shard keeps each rank's slice of what it holds: one start
        draft = module.draft
        low = torch.bfloat16 if precision == "bf16" else None
        # Inputs are not cast: autocast runs the matmuls in bf16 as it does replicated, and the residual stream, the
        # RoPE tables and the norms stay fp32 (casting a layer's inputs put them in bf16: 0.8% off in the first loss)
        units = dict(mp_policy=MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32,
                                                    cast_forward_inputs=False),
                     offload_policy=CPUOffloadPolicy() if offload_optimizer else OffloadPolicy())
        # The frozen verifier embedding is read whole by every step: kept whole, in the compute dtype, on each rank.
        frozen = {p for p in module.parameters() if not p.requires_grad}
        for layer in draft.layers:
            # A layer runs once per TTT step; kept gathered from its first step to the end of the backward
            fully_shard(layer, reshard_after_forward=False, **units)
            register_fsdp_forward_method(layer, "ttt")  # the trainer calls layer.ttt, not forward
        fully_shard(draft.fc, **units)
        # The root (lm_head, norms, an own embedding): its forward is the TTT unroll, gathered once for it and
        # reduced once after the backward however often the loss calls lm_head (the targets' float64 denominators
        # must not be cast either)
        fully_shard(module, ignored_params=frozen, **units)

    def sync(self, last: bool):
        self.module.set_requires_gradient_sync(last)
        return contextlib.nullcontext()


def make_engine(name: str, module: TTTModule, info: DistInfo, device: torch.device, precision: str,
                offload_optimizer: bool = False) -> Engine:
    """The engine `name` (resolved by `choose_engine`) over `module`; one process needs none. (Muon with
    offload_optimizer is refused by TrainConfig itself: settings/train.py `refuse_muon_offload`.)"""
    if offload_optimizer and name != "fsdp":
        raise Eagle3InputError("train.offload_optimizer needs train.parallel fsdp (FSDP2's CPU offload)")
    if name == "fsdp" and dist.is_initialized():  # under torchrun, a group of one too (a check of the FSDP path)
        return FSDPEngine(module, info, device, precision, offload_optimizer)
    if info.world_size == 1:
        return Engine(module, info, device)
    return DDPEngine(module, info, device)
