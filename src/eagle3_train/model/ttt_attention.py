"""Attention of a later training-time-test step (j >= 1): queries q [B, h, L, d] see the step-0 keys k0 [B, kvh, L, d]
causally plus, per later step i <= j, the key at their own position (k_diag[i] [B, kvh, L, d]).

Two implementations of the same function:
- `merged` (default where a backend exists): one causal flash-attention call over the step-0 keys, which returns its
  logsumexp, merged with the j diagonal scores per query through logsumexp (as ring attention merges blocks). Nothing
  of size L x L exists: memory grows linearly in L (benchmarks/long_context_memory.py) and the kernel skips the upper
  triangle. Its backward runs the kernel's own backward with the merged output and logsumexp, which is exactly the
  gradient of the merged softmax on the prefix keys (the kernel's P = exp(S - lse) and D = rowsum(dO * O) are then the
  merged ones), plus the diagonal terms computed here.
- `masked`: fused SDPA calls over concatenated keys with a block mask [causal | I | ... | I], queries in blocks
  (`query_block`, default L/4 and at least 128). Masks of (L/4) x L per block make it quadratic in L; it runs where
  no backend returns the logsumexp (CUDA in fp32, other devices) and is the reference the merged one is checked
  against (`check_merged`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle3_train.model.config import default_ttt_query_block

log = logging.getLogger(__name__)


def masked_ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, k_diag: list[torch.Tensor],
                         v_diag: list[torch.Tensor], query_block: int | None = None,
                         scale: float | None = None) -> torch.Tensor:
    """One masked SDPA call per query block: each block against the prefix up to its end and its own rows' diagonal
    keys, ~L^2 (5/8 + j/4) scores with 4 blocks instead of L^2 (j+1) (benchmarks/README.md, ttt_attention_memory.py)."""
    L = q.shape[2]
    block = query_block or default_ttt_query_block(L)
    outs = []
    for s in range(0, L, block):
        e = min(s + block, L)
        keys = torch.cat([k0[:, :, :e], *(kd[:, :, s:e] for kd in k_diag)], dim=2)
        values = torch.cat([v0[:, :, :e], *(vd[:, :, s:e] for vd in v_diag)], dim=2)
        causal = torch.ones(e - s, e, dtype=torch.bool, device=q.device).tril(diagonal=s)
        eye = torch.eye(e - s, dtype=torch.bool, device=q.device)
        mask = torch.cat([causal] + [eye] * len(k_diag), dim=1)
        outs.append(F.scaled_dot_product_attention(q[:, :, s:e], keys, values, attn_mask=mask, enable_gqa=True,
                                                   scale=scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


@dataclass(frozen=True)
class CausalKernel:
    """A causal flash-attention kernel that returns its logsumexp, and its backward taking an output and logsumexp.
    forward(q, k, v, scale) -> (out, lse [B, h, L] fp32, state); backward(do, q, k, v, out, lse, state, scale)
    -> (dq, dk, dv); q, k, v with the same number of heads."""
    forward: Callable
    backward: Callable
    dtypes: tuple[torch.dtype, ...]


def _cpu_forward(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _cpu_backward(do, q, k, v, out, lse, state, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, out, lse, 0.0, True,
                                                                                scale=scale)


def _cuda_forward(q, k, v, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cuda_backward(do, q, k, v, out, lse, state, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = state
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)


KERNELS: dict[str, CausalKernel] = {
    "cpu": CausalKernel(_cpu_forward, _cpu_backward, (torch.float32, torch.bfloat16, torch.float16)),
    # flash attention on CUDA takes half precision only; fp32 training there runs `masked`
    "cuda": CausalKernel(_cuda_forward, _cuda_backward, (torch.bfloat16, torch.float16)),
}
_FAILED: set[tuple[str, torch.dtype]] = set()  # (device type, dtype) where `check_merged` disagreed with `masked`


def _heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _kv_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum a gradient over the query heads that share a key/value head."""
    B, h, L, d = x.shape
    return x if groups == 1 else x.view(B, h // groups, groups, L, d).sum(2)


class _Merged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel: CausalKernel, scale: float, q, k0, v0, *diag):
        with torch.autocast(q.device.type, enabled=False):
            return _Merged._forward(ctx, kernel, scale, q, k0, v0, *diag)

    @staticmethod
    def _forward(ctx, kernel: CausalKernel, scale: float, q, k0, v0, *diag):
        j = len(diag) // 2
        g = q.shape[1] // k0.shape[1]
        o1, lse1, state = kernel.forward(q, _heads(k0, g), _heads(v0, g), scale)
        qf = q.float()
        s = torch.stack([(qf * _heads(k, g)).sum(-1) for k in diag[:j]], -1) * scale  # [B, h, L, j] fp32
        lse = torch.logaddexp(lse1, torch.logsumexp(s, -1))
        out = torch.exp(lse1 - lse).unsqueeze(-1) * o1
        p = torch.exp(s - lse.unsqueeze(-1))
        for i, v in enumerate(diag[j:]):
            out = out + p[..., i, None] * _heads(v, g)
        out = out.to(q.dtype)
        ctx.kernel, ctx.scale, ctx.state = kernel, scale, state
        ctx.save_for_backward(q, k0, v0, out, lse, *diag)
        return out

    @staticmethod
    def backward(ctx, do):
        with torch.autocast(do.device.type, enabled=False):
            return _Merged._backward(ctx, do)

    @staticmethod
    def _backward(ctx, do):
        q, k0, v0, out, lse, *diag = ctx.saved_tensors
        j, g, scale = len(diag) // 2, q.shape[1] // k0.shape[1], ctx.scale
        do = do.contiguous()
        dq, dk0, dv0 = ctx.kernel.backward(do, q, _heads(k0, g), _heads(v0, g), out, lse, ctx.state, scale)
        dq, qf, dof = dq.float(), q.float(), do.float()
        rowsum = (dof * out.float()).sum(-1)  # D of the merged softmax
        dk, dv = [], []
        for k, v in zip(diag[:j], diag[j:]):
            kf, vf = _heads(k, g).float(), _heads(v, g).float()
            p = torch.exp((qf * kf).sum(-1) * scale - lse)
            ds = p * ((dof * vf).sum(-1) - rowsum)
            dq = dq + scale * ds.unsqueeze(-1) * kf
            dk.append(_kv_heads(scale * ds.unsqueeze(-1) * qf, g).to(k.dtype))
            dv.append(_kv_heads(p.unsqueeze(-1) * dof, g).to(v.dtype))
        return None, None, dq.to(q.dtype), _kv_heads(dk0, g), _kv_heads(dv0, g), *dk, *dv


def merged_available(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this kind of device has a merged kernel for `dtype` (the planner's question; no check runs)."""
    return device_type in KERNELS and dtype in KERNELS[device_type].dtypes


def merged_kernel(device: torch.device, dtype: torch.dtype) -> CausalKernel | None:
    if not merged_available(device.type, dtype) or (device.type, dtype) in _FAILED:
        return None
    return KERNELS[device.type]


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, k_diag: list[torch.Tensor],
                  v_diag: list[torch.Tensor], query_block: int | None = None, scale: float | None = None,
                  merged: bool = True) -> torch.Tensor:
    """The later-step attention, `merged` where this device and dtype have a kernel (q, k, v of one dtype)."""
    kernel = merged_kernel(q.device, q.dtype) if merged else None
    if kernel is None:
        return masked_ttt_attention(q, k0, v0, k_diag, v_diag, query_block, scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _Merged.apply(kernel, scale, q, k0, v0, *k_diag, *v_diag)


def check_merged(device: torch.device, dtype: torch.dtype, heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 64) -> bool:
    """Compare `merged` with `masked` on a small random problem on this device and dtype, outputs and gradients;
    a kernel that disagrees is not used again in this process. For devices CI never sees (the trainer checks before
    training); the generator is local, so the run's random state is untouched."""
    if merged_kernel(device, dtype) is None:
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    B, L, j = 2, 96, 3

    def rand(h: int) -> torch.Tensor:
        return torch.randn(B, h, L, head_dim, generator=gen, device=device, dtype=dtype).requires_grad_()

    q, k0, v0 = rand(heads), rand(kv_heads), rand(kv_heads)
    kd, vd = [rand(kv_heads) for _ in range(j)], [rand(kv_heads) for _ in range(j)]
    weight = torch.randn(B, heads, L, head_dim, generator=gen, device=device)
    inputs = [q, k0, v0, *kd, *vd]
    results = []
    with torch.enable_grad(), torch.autocast(device.type, enabled=False):
        for merged in (True, False):
            try:
                out = ttt_attention(q, k0, v0, kd, vd, merged=merged)
                grads = torch.autograd.grad((out.float() * weight).sum(), inputs)
            except RuntimeError as e:  # e.g. a head width this device's kernel does not take
                if not merged:
                    raise
                log.warning("the merged TTT attention kernel fails on %s in %s: %s", device.type, dtype, e)
                _FAILED.add((device.type, dtype))
                return False
            results.append([out.detach(), *grads])
    # half precision: both sides round to 8 bits of mantissa, in different orders (~1% of the largest value)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    ok = all(((a.float() - b.float()).abs().max() <= tol * b.float().abs().max()).item()
             for a, b in zip(*results))
    if not ok:
        _FAILED.add((device.type, dtype))
    return ok


def select_kernel(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int] = (4, 2, 64)) -> str:
    """Which later-step attention training runs on this device in this compute dtype, for attention of `shape`
    (query heads, key/value heads, head width): `merged` where a kernel exists and agrees with `masked` here
    (`check_merged`), else `masked` (logged: its memory grows as L^2)."""
    available = merged_kernel(device, dtype) is not None
    if available and check_merged(device, dtype, *shape):
        return "merged"
    why = "the merged kernel disagreed with the masked reference here" if available else "no merged kernel there"
    log.warning("TTT attention on %s in %s: masked query blocks (%s); memory grows as L^2 with the sample length",
                device.type, dtype, why)
    return "masked"
