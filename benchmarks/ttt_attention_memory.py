"""Later-step TTT attention: explicit softmax over [prefix scores | diagonal scores], one masked SDPA call over
concatenated keys, masked SDPA calls per query block (`masked_ttt_attention`, the fallback) and the causal kernel
merged with the diagonal through logsumexp (`ttt_attention`, what the draft runs). Same outputs; prints time and peak
RSS of fwd+bwd over 7 steps, one process per variant.

  .venv/bin/python benchmarks/ttt_attention_memory.py explicit
  .venv/bin/python benchmarks/ttt_attention_memory.py sdpa
  .venv/bin/python benchmarks/ttt_attention_memory.py blocks
  .venv/bin/python benchmarks/ttt_attention_memory.py merged
"""

from __future__ import annotations

import resource
import sys
import time

import torch
import torch.nn.functional as F

from eagle3_train.model.ttt_attention import masked_ttt_attention, ttt_attention

B, H, KVH, L, D, STEPS = 4, 9, 3, 512, 64, 7


def explicit(q, k0, v0, kd, vd):
    g = H // KVH
    qg = q.view(B, KVH, g, L, D)
    main = torch.matmul(qg, k0.unsqueeze(2).transpose(-1, -2)) * D ** -0.5
    main = main.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    diag = torch.stack([(qg * k.unsqueeze(2)).sum(-1) for k in kd], -1) * D ** -0.5
    p = torch.softmax(torch.cat([main, diag], -1), -1)
    out = torch.matmul(p[..., :L], v0.unsqueeze(2))
    out = out + (p[..., L:].unsqueeze(-1) * torch.stack(vd, -2).unsqueeze(2)).sum(-2)
    return out.reshape(B, H, L, D)


def sdpa(q, k0, v0, kd, vd):
    keys, values = torch.cat([k0, *kd], 2), torch.cat([v0, *vd], 2)
    mask = torch.cat([torch.ones(L, L, dtype=torch.bool).tril()] + [torch.eye(L, dtype=torch.bool)] * len(kd), 1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


def blocks(q, k0, v0, kd, vd):
    return masked_ttt_attention(q, k0, v0, kd, vd)


def merged(q, k0, v0, kd, vd):
    return ttt_attention(q, k0, v0, kd, vd)


def main() -> None:
    fn = {"explicit": explicit, "sdpa": sdpa, "blocks": blocks, "merged": merged}[
        sys.argv[1] if len(sys.argv) > 1 else "merged"]
    torch.manual_seed(0)
    q = [torch.randn(B, H, L, D, requires_grad=True) for _ in range(STEPS)]
    k = [torch.randn(B, KVH, L, D, requires_grad=True) for _ in range(STEPS)]
    v = [torch.randn(B, KVH, L, D, requires_grad=True) for _ in range(STEPS)]
    with torch.no_grad():
        for other in (sdpa, blocks, merged):
            torch.testing.assert_close(explicit(q[3], k[0], v[0], k[1:4], v[1:4]),
                                       other(q[3], k[0], v[0], k[1:4], v[1:4]), rtol=1e-4, atol=1e-5)
    t0 = time.perf_counter()
    total = sum(fn(q[j], k[0], v[0], k[1:j + 1], v[1:j + 1]).sum() for j in range(1, STEPS))
    total.backward()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{fn.__name__}: {time.perf_counter() - t0:.2f} s fwd+bwd, peak RSS {rss:.0f} MB")


if __name__ == "__main__":
    main()
