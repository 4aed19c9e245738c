"""Real prepare -> vocab -> extract outputs on a tiny random Llama verifier, shared by the training tests, and the
kill-and-compare steps of the extract resume tests (HF and vLLM backends)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from eagle3_train.data.prepare import prepare
from eagle3_train.hidden_states.extract import extract
from eagle3_train.hidden_states.store import HiddenStatesReader
from eagle3_train.settings.train import TrainConfig
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


def kill_after_first_shard(cmd: list[str], env: dict[str, str], out: Path) -> dict:
    """Run an extract command writing to `out` and SIGKILL it as soon as train/index.json lists a finished shard;
    returns that index (what a kill -9 mid-run leaves)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    index_path = out / "train" / "index.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if index_path.is_file() and json.loads(index_path.read_text())["shards"]:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "extraction finished before it could be killed:\n" + proc.stdout.read().decode()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    return json.loads(index_path.read_text())


def assert_same_hidden_states(expected: Path, actual: Path, splits) -> None:
    """Both extract outputs hold the same samples with bit-identical aux and final states."""
    for split in splits:
        want, got = HiddenStatesReader(expected, split), HiddenStatesReader(actual, split)
        assert got.sample_indices == want.sample_indices, split
        for i in want.sample_indices:
            a, b = want.load(i), got.load(i)
            assert torch.equal(a["aux"], b["aux"]) and torch.equal(a["final"], b["final"]), (split, i)


@contextmanager
def another_writer(holding: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """A live process inside `with HOLDING as x:` (an expression of eagle3_train.utils.outputs, e.g.
    "output_lock('/out', 'x')"), as a second writer meets it: yields (the process, what it printed of x)."""
    code = (f"import time\nfrom eagle3_train.utils.outputs import *  # noqa\nwith {holding} as x:\n"
            f"    print(x, flush=True)\n    time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        yield proc, proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
