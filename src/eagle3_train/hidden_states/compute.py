"""One shard's hidden states, computed in padded batches by a producer (HF or vLLM) and checked as they come."""

from __future__ import annotations

from collections.abc import Sequence

from eagle3_train.hidden_states import store
from eagle3_train.hidden_states.hf_backend import plan_batches
from eagle3_train.utils.io import Eagle3InputError


def _check_finite(aux, final, lengths: Sequence[int], sample_ids: Sequence[str], split: str, dtype: str) -> None:
    import torch

    bad = ~(torch.isfinite(aux).all(dim=-1) & torch.isfinite(final).all(dim=-1))
    if not bool(bad.any()):
        return
    row = int(bad.nonzero()[0, 0])
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    k = int(torch.searchsorted(offsets, torch.tensor(row), right=True)) - 1
    hint = " (float16 overflows above 65504: try --dtype bfloat16)" if dtype == "float16" else ""
    raise Eagle3InputError(f"the verifier produced NaN/Inf hidden states for sample id {sample_ids[k]!r} "
                           f"(split '{split}', token {row - int(offsets[k])}){hint}; check the verifier weights "
                           f"and --compute-dtype")


def compute_shard(plan: store.ShardPlan, rows: dict[str, list], compute, bar, *, split: str, token_budget: int,
                   width: tuple[int, int], store_dtype, dtype: str, stats_fn=None):
    """(aux [N, 3H], final [N, H], stats) of one shard's samples, in batches of at most `token_budget` padded tokens;
    stats: (full-vocab argmax [N], logsumexp [N]) from `stats_fn` applied to the final state as stored, or None."""
    import torch

    from eagle3_train.hidden_states import fp8

    for sid, seq, n in zip(rows["id"], rows["input_ids"], plan.lengths):
        if len(seq) != n:
            raise Eagle3InputError(f"sample id {sid!r} (split '{split}'): column 'length' says {n} but "
                                   f"input_ids has {len(seq)} tokens")
    aux = torch.empty((plan.num_tokens, width[0]), dtype=store_dtype)
    final = torch.empty((plan.num_tokens, width[1]), dtype=store_dtype)
    top = torch.empty(plan.num_tokens, dtype=torch.int32) if stats_fn else None
    lse = torch.empty(plan.num_tokens, dtype=torch.float32) if stats_fn else None
    row = 0
    with torch.inference_mode():
        for b0, b1 in plan_batches(plan.lengths, token_budget):
            n_tok = sum(plan.lengths[b0:b1])
            if n_tok:
                a, f = compute(rows["input_ids"][b0:b1])
                _check_finite(a, f, plan.lengths[b0:b1], rows["id"][b0:b1], split, dtype)
                aux[row:row + n_tok] = a.cpu()
                final[row:row + n_tok] = f.cpu()
                if stats_fn is not None:  # from what training will read: fp8 is quantized per row, so per batch
                    h = fp8.decode_rows(*fp8.encode_rows(f), torch.float32) if dtype == fp8.STORE_NAME else f.float()
                    t, z = stats_fn(h)
                    if not bool(torch.isfinite(z).all()):
                        raise Eagle3InputError(f"the verifier's full-vocabulary logsumexp is NaN/Inf in a batch of "
                                               f"split '{split}' (sample ids {rows['id'][b0]!r}..); check the "
                                               f"verifier's lm_head weights")
                    top[row:row + n_tok], lse[row:row + n_tok] = t.cpu(), z.cpu()
            row += n_tok
            bar.update(n_tok)
    return aux, final, (None if stats_fn is None else (top, lse))
