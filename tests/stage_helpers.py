"""Real prepare -> vocab -> extract outputs on a tiny random Llama verifier, shared by the training tests."""

from __future__ import annotations

from pathlib import Path

from eagle3_train.data.prepare import prepare
from eagle3_train.hidden_states.extract import extract
from eagle3_train.train.config import TrainConfig
from eagle3_train.vocab.build import build_vocab


def build_stages(root: Path, verifier: Path) -> Path:
    """24 ShareGPT conversations (max 192 tokens, 3 for validation), a 1024-token and a 700-token draft vocab."""
    prepare("sharegpt", verifier, root / "prepared", max_length=192, limit=24, val_count=3, seed=0)
    build_vocab(root / "prepared", root / "vocab", size=1024)
    build_vocab(root / "prepared", root / "vocab-small", size=700)
    extract(root / "prepared", verifier, root / "hidden", dtype="float32", token_budget=2048)
    return root


def train_config(root: Path, out: Path, **kw) -> TrainConfig:
    base = dict(prepared=str(root / "prepared"), hidden_states=str(root / "hidden"), vocab=str(root / "vocab"),
                out=str(out), ttt_steps=3, token_budget=512, lr=3e-3, warmup_ratio=0.1, log_every=1,
                tensorboard=False, seed=0)
    base.update(kw)
    return TrainConfig(**base)
