"""`train.optimizer: muon`: Muon on the fc and decoder-layer matrices, AdamW on the lm_head and norms."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from support.stage_helpers import train_config

from eagle3_train.train.batching import plan_batches
from eagle3_train.train.build import build_model
from eagle3_train.train.inputs import resolve_inputs
from eagle3_train.train.optimizer import muon_parameter_names
from eagle3_train.train.trainer import Trainer, train
from eagle3_train.utils.io import Eagle3InputError


def test_muon_takes_the_matrices_but_not_the_head(tiny_stages):
    root, _ = tiny_stages
    cfg = train_config(root, root / "unused")
    names = set(muon_parameter_names(build_model(cfg, resolve_inputs(cfg))))
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.o_proj.weight",
            "layers.0.mlp.down_proj.weight"} <= names
    assert not any(n.startswith(("lm_head", "embed_tokens")) or "norm" in n for n in names)


def test_muon_with_offloaded_states_is_refused_by_the_settings():
    """Muon's step gathers whole matrices on the GPUs; offloaded states live on the CPU: refused before any work."""
    from eagle3_train.settings.train import TrainConfig

    with pytest.raises(Eagle3InputError, match="set train.optimizer adamw with offload_optimizer"):
        TrainConfig(offload_optimizer=True)
    assert TrainConfig(offload_optimizer=True, optimizer="adamw").offload_optimizer


def test_muon_leaves_an_own_embedding_to_adamw():
    from eagle3_train.model.config import DraftConfig
    from eagle3_train.model.draft import Eagle3Draft

    # narrower than its verifier: it trains its own embedding table
    cfg = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                      vocab_size=256, draft_vocab_size=32, target_hidden_size=96)
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    names = muon_parameter_names(draft)
    assert draft.embed_tokens.weight.requires_grad and "fc.weight" in names
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)


@pytest.mark.parametrize(("lr", "muon_lr", "expected"), [(0.002, None, 0.002), (0.002, 0.005, 0.005),
                                                          (0.002, 0.0, 0.0), (0.0, 0.005, 0.0)])
def test_the_muon_rate_is_muon_lr_else_lr_and_zero_with_lr_zero(lr, muon_lr, expected):
    """lr 0 checks that a finetune loads unchanged: no group moves, whatever muon_lr says; muon_lr 0 is 0."""
    from types import SimpleNamespace

    from eagle3_train.train.optimizer import muon_lr as rate

    assert rate(SimpleNamespace(lr=lr, muon_lr=muon_lr)) == expected


def test_one_step_is_muon_on_the_matrices_and_adamw_on_the_head(tiny_stages, tmp_path):
    """One training step: each matrix moves exactly as a bare torch.optim.Muon step on its gradient, and the lm_head
    exactly as a bare AdamW step."""
    root, _ = tiny_stages
    cfg = train_config(root, tmp_path / "run", max_steps=1, warmup_ratio=0.0, optimizer="muon", grad_clip=0.0,
                       muon_lr=0.01)
    trainer = Trainer(cfg)
    params = dict(trainer.model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    plan = plan_batches(trainer.train_data.lengths, cfg.token_budget, cfg.seed, 0)
    trainer.train_step(plan[:1])
    for name, opt, kw in (("fc.weight", torch.optim.Muon, dict(lr=0.01, momentum=cfg.muon_momentum,
                                                                 weight_decay=cfg.muon_weight_decay,
                                                                 adjust_lr_fn="match_rms_adamw")),
                          ("layers.0.mlp.up_proj.weight", torch.optim.Muon, dict(
                              lr=0.01, momentum=cfg.muon_momentum, weight_decay=cfg.muon_weight_decay,
                              adjust_lr_fn="match_rms_adamw")),
                          ("lm_head.weight", torch.optim.AdamW, dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                                                     weight_decay=cfg.weight_decay))):
        ref = torch.nn.Parameter(before[name].clone())
        ref.grad = params[name].grad.clone()
        opt([ref], **kw).step()
        torch.testing.assert_close(params[name].detach(), ref.detach(), atol=0, rtol=0, msg=name)
    trainer.train_data.close()


def test_a_muon_run_resumes_exactly(tiny_stages, tmp_path):
    root, _ = tiny_stages
    train(train_config(root, tmp_path / "straight", max_steps=4, optimizer="muon"))
    train(train_config(root, tmp_path / "resumed", max_steps=4, optimizer="muon", stop_after=2))
    train(train_config(root, tmp_path / "resumed", max_steps=4, optimizer="muon", resume=True))
    a, b = (load_file(tmp_path / n / "final" / "model.safetensors") for n in ("straight", "resumed"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # a checkpoint of one optimizer does not silently resume under the other
    with pytest.raises(Eagle3InputError, match="optimizer"):
        train(train_config(root, tmp_path / "resumed", max_steps=6, optimizer="adamw", resume=True))


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_the_planned_optimizer_state_is_what_the_optimizer_holds(tiny_stages, tmp_path, optimizer):
    """plan and the dry run count `optimizer_state_bytes`: after a real step, the optimizers' state tensors (steps
    excepted: scalars) take exactly that many bytes, under either optimizer."""
    from eagle3_train.model.optimizer_groups import muon_parameter_sizes, optimizer_state_bytes

    root, _ = tiny_stages
    cfg = train_config(root, tmp_path / "run", max_steps=1, optimizer=optimizer)
    trainer = Trainer(cfg)
    trainer.train_step(plan_batches(trainer.train_data.lengths, cfg.token_budget, cfg.seed, 0)[:1])
    held = sum(t.numel() * t.element_size() for o in trainer.optimizer.optimizers for st in o.state.values()
               for t in st.values() if isinstance(t, torch.Tensor) and t.ndim > 0)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    muon, largest = muon_parameter_sizes(trainer.model)
    assert held == optimizer_state_bytes(optimizer, trainable, muon)
    assert 0 < largest < muon < trainable
    trainer.train_data.close()
