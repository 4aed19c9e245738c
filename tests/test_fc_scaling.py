"""`train.equalise_features`: Adam on the fc weight as if every aux feature had the median feature's std, with the
served weight W unchanged in form (train/fc_scaling.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from stage_helpers import train_config

from eagle3_train.train.data import TrainingSamples
from eagle3_train.train.fc_scaling import EqualisedFC, feature_scale
from eagle3_train.train.trainer import train


def test_the_scale_is_each_features_std_over_the_median(tiny_stages):
    root, _ = tiny_stages
    data = TrainingSamples(root / "prepared", root / "hidden", "train")
    s = feature_scale(data)
    batch = data.batch(list(range(len(data))))
    real = torch.arange(batch.aux.shape[1]).unsqueeze(0) < batch.lengths.unsqueeze(1)
    std = batch.aux[real].float().std(dim=0, correction=0)
    assert s.shape == std.shape and float(s.median()) == 1.0
    torch.testing.assert_close(s, (std / std.median()).clamp(min=1e-2))  # the fixture has fewer rows than sampled
    data.close()


OPTIMIZERS = {"adamw": (lambda p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1), 1e-5),
              # Muon's Newton-Schulz runs in bf16 on gradients that differ in their last float bits
              "muon": (lambda p: torch.optim.Muon([p], lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
                       1e-4)}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_optimizer_on_w_runs_as_on_v_over_standardised_features(name):
    """W with EqualisedFC on features x, step by step, equals V = W * s trained by the plain optimizer on x / s."""
    make, rtol = OPTIMIZERS[name]
    torch.manual_seed(0)
    scale = torch.tensor([0.02, 0.5, 1.0, 1.0, 30.0, 300.0])
    x = torch.randn(64, 6) * scale
    y = torch.randn(64, 3)
    w = torch.nn.Parameter(torch.randn(3, 6) * 0.1)
    v = torch.nn.Parameter(w.detach() * scale)
    adam_w, adam_v = make(w), make(v)
    plain = torch.nn.Parameter(w.detach().clone())  # W under the plain optimizer: what the option changes
    adam_plain = make(plain)
    eq = EqualisedFC(w, scale)
    for _ in range(5):
        for p, opt, inputs in ((w, adam_w, x), (v, adam_v, x / scale), (plain, adam_plain, x)):
            opt.zero_grad()
            ((inputs @ p.T - y) ** 2).mean().backward()
            if p is w:
                eq.precondition()
                eq.step(adam_w)
            else:
                opt.step()
        torch.testing.assert_close(w.detach() * scale, v.detach(), rtol=rtol, atol=1e-6)
    assert not torch.allclose(plain.detach() * scale, v.detach(), rtol=10 * rtol, atol=1e-4)


def test_a_run_equalises_the_fc_and_resumes_exactly(tiny_stages, tmp_path):
    root, _ = tiny_stages
    for name, kw in (("plain", {}), ("straight", {"equalise_features": True})):
        train(train_config(root, tmp_path / name, max_steps=4, **kw))
    train(train_config(root, tmp_path / "resumed", max_steps=4, equalise_features=True, stop_after=2))
    train(train_config(root, tmp_path / "resumed", max_steps=4, equalise_features=True, resume=True))
    w = {n: load_file(tmp_path / n / "final" / "model.safetensors") for n in ("plain", "straight", "resumed")}
    assert not torch.equal(w["plain"]["fc.weight"], w["straight"]["fc.weight"])
    assert w["straight"].keys() == w["plain"].keys()  # the served tensors: nothing added
    for k in w["straight"]:
        assert torch.equal(w["straight"][k], w["resumed"][k]), k


class _Rows:
    """Samples whose rows differ by rank (as each rank's fetches may), recording who fetched."""

    def __init__(self, rank: int, fetched: str):
        self.rank, self.fetched = rank, fetched

    def __len__(self) -> int:
        return 4

    def batch(self, rows):
        from eagle3_train.train.data import Batch

        open(self.fetched, "a").write(f"{self.rank}\n")
        g = torch.Generator().manual_seed(self.rank)
        aux = torch.randn(len(rows), 5, 12, generator=g) * torch.arange(1, 13)
        lengths = torch.full((len(rows),), 5)
        return Batch(torch.zeros(len(rows), 5, dtype=torch.long), torch.ones(len(rows), 5, dtype=torch.bool), aux,
                     torch.zeros(len(rows), 5, 4), lengths)


def _rank(rank: int, port: int, fetched: str, out: str) -> None:
    import torch.distributed as dist

    from eagle3_train.train.distributed import DistInfo
    from eagle3_train.train.fc_scaling import shared_feature_scale

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.save(shared_feature_scale(_Rows(rank, fetched), 12, DistInfo(rank, 2, rank)), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_every_rank_trains_with_rank_zeros_scale_and_only_rank_zero_fetches(tmp_path):
    """Under torchrun the statistics come from rank 0's rows only: the same s on every rank, and no other rank
    fetches rows (in hybrid mode each fetch stores shards, and the same rows fetched twice were stored twice)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fetched, out = tmp_path / "fetched", tmp_path / "scale"
    mp.spawn(_rank, args=(port, str(fetched), str(out)), nprocs=2)
    assert fetched.read_text() == "0\n"
    s0, s1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert torch.equal(s0, s1) and torch.equal(s0, feature_scale(_Rows(0, str(tmp_path / "again"))))
