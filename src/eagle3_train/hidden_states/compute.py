"""A split's hidden states as extract computes them: its shard plan (`plan_split`), its shards computed and written
in rounds of one shard per process (`compute_split`), and one shard's states computed in padded batches by a producer
(HF or vLLM) and checked as they come (`compute_shard`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_train.hidden_states import store
from eagle3_train.hidden_states.hf_backend import plan_batches
from eagle3_train.utils.io import Eagle3InputError, write_json

if TYPE_CHECKING:
    from eagle3_train.hidden_states.parallel import ExtractGroup
    from eagle3_train.hidden_states.source import HiddenStateProducer


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


def plan_split(ds, split: str, max_samples: int | None, shard_tokens: int, text_config) -> list[store.ShardPlan]:
    """The shards of one split, after checking that no sample is longer than the verifier's positions."""
    lengths = ds.data.column("length").to_pylist()
    if max_samples is not None:
        lengths = lengths[:max_samples]
    max_pos = getattr(text_config, "max_position_embeddings", None)
    if max_pos and lengths and max(lengths) > max_pos:
        r = max(range(len(lengths)), key=lengths.__getitem__)
        raise Eagle3InputError(f"sample id {ds[r]['id']!r} (split '{split}') has {lengths[r]} tokens, "
                               f"more than the verifier's max_position_embeddings {max_pos}; prepare with a "
                               f"shorter max length")
    return store.plan_shards(lengths, shard_tokens)


def compute_split(ds, split: str, plans: list[store.ShardPlan], done: dict[int, dict], split_dir: Path,
                  open_producer: Callable[[], HiddenStateProducer], bar, stats: dict, group: ExtractGroup, *,
                  layer_ids: Sequence[int], token_budget: int, width: tuple[int, int], store_dtype, dtype: str) -> dict:
    """Compute and write the shards of one split not in `done` (updated, with index.json after each round of one
    shard per process; `open_producer` is called only when a shard is left); returns the split's manifest entry."""
    split_dir.mkdir(parents=True, exist_ok=True)
    todo = [p for p in plans if p.number not in done]
    producer = open_producer() if todo else None
    if group.is_main:
        write_json(split_dir / "index.json", store.split_index(split, plans, done))
    columns = ds.select_columns(["id", "input_ids"])
    for first in range(0, len(todo), group.world):
        plan = todo[first + group.rank] if first + group.rank < len(todo) else None
        entry = None
        if plan is not None:
            bar.set_postfix_str(f"{split} shard {plan.number + 1}/{len(plans)}")
            rows = columns[list(plan.rows)]
            t0 = time.perf_counter()
            aux, final, vstats = compute_shard(plan, rows, producer.run_batch, bar, split=split,
                                               token_budget=token_budget, width=width, store_dtype=store_dtype,
                                               dtype=dtype, stats_fn=producer.stats)
            t1 = time.perf_counter()
            meta = {"format": store.FORMAT, "split": split, "shard": str(plan.number),
                    "layer_ids": ",".join(map(str, layer_ids)), "dtype": dtype}
            path = split_dir / f"shard-{plan.number:05d}.safetensors"
            entry = (plan.number, store.write_shard(path, aux, final, plan, meta, vstats), plan.num_tokens)
            stats["forward_s"] += t1 - t0
            stats["write_s"] += time.perf_counter() - t1
            stats["tokens"] += plan.num_tokens
        for rank, got in enumerate(group.gather(entry)):
            if got is not None:
                done[got[0]] = got[1]
                if rank != group.rank:
                    bar.update(got[2])  # the other processes' tokens
        if group.is_main:
            write_json(split_dir / "index.json", store.split_index(split, plans, done))
    index = store.split_index(split, plans, done)
    if group.is_main:
        write_json(split_dir / "index.json", index)
    return {"num_samples": index["num_samples"], "num_tokens": index["num_tokens"],
            "num_shards": index["num_shards"], "bytes": sum(e["bytes"] for e in index["shards"]),
            "complete": index["complete"]}
