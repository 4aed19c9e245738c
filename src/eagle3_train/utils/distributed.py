"""torch.distributed under torchrun (gloo on CPU, NCCL on CUDA): this process's rank and device, and the small
collectives the stages' bookkeeping needs. Gradients are reduced by torch's engines (train/parallel.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from eagle3_train.utils.io import Eagle3InputError


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False  # this process group was created here (destroy() ends it, even in a world of one)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> DistInfo:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and "TORCHELASTIC_RUN_ID" not in os.environ:  # torchrun of one process: a group of one (FSDP)
        return DistInfo()
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    info = DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), owns)
    if device_type == "cpu":
        # Share the cores between the local processes instead of oversubscribing them.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return info


def check_device(device: str | None, flag: str = "--device") -> None:
    """A device this machine has: auto, cpu or cuda[:N] (a CUDA one only where torch sees a GPU)."""
    if device in (None, "", "auto"):
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise Eagle3InputError(f"{flag} must be auto, cpu or cuda[:N], got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):  # mps, xpu, meta parse as devices but the trainer runs on neither
        raise Eagle3InputError(f"{flag} must be auto, cpu or cuda[:N], got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise Eagle3InputError(f"{flag} {device} was requested but torch sees no CUDA device "
                               f"(torch {torch.__version__}); use {flag} cpu (or auto)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise Eagle3InputError(f"{flag} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def init_device(device: str) -> tuple[DistInfo, torch.device]:
    """This process's rank and device for `train.device`: auto (cuda if available), cpu or cuda[:N]; a CUDA device
    without an index is the local rank's GPU, and becomes the current device."""
    check_device(device)
    use_cuda = (device == "auto" and torch.cuda.is_available()) or device.startswith("cuda")
    info = init_distributed("cuda" if use_cuda else "cpu")
    if device == "auto":
        dev = torch.device(f"cuda:{info.local_rank}" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device(f"cuda:{info.local_rank}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return info, dev


def broadcast_parameters(model: torch.nn.Module, info: DistInfo) -> None:
    if info.world_size > 1:
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)


def broadcast_(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Rank 0's `t` on every rank (in place); NCCL broadcasts from the GPU, so a CPU tensor takes a round trip."""
    if info.world_size > 1:
        if dist.get_backend() == "nccl" and t.device.type != "cuda":
            on_gpu = t.to(f"cuda:{info.local_rank}")
            dist.broadcast(on_gpu, src=0)
            t.copy_(on_gpu.cpu())
        else:
            dist.broadcast(t, src=0)
    return t


def all_reduce_sum_(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """In-place sum across ranks; CPU bookkeeping tensors take a round trip through the GPU under NCCL."""
    if info.world_size > 1:
        if dist.get_backend() == "nccl" and t.device.type == "cpu":
            on_gpu = t.to(f"cuda:{info.local_rank}")
            dist.all_reduce(on_gpu, op=dist.ReduceOp.SUM)
            t.copy_(on_gpu.cpu())
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_object(obj, info: DistInfo) -> list:
    """Every rank's `obj`, in rank order (a list of one in a single process)."""
    if info.world_size <= 1:
        return [obj]
    out: list = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()


def destroy(info: DistInfo) -> None:
    if (info.world_size > 1 or info.owns_group) and dist.is_initialized():
        dist.destroy_process_group()
