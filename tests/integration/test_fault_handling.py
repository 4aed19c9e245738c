"""Faults found by the reliability campaign (scripts/reliability_campaign.py), each handled as a clear error:
NaN/Inf in stored hidden states, prepared data from another tokenizer, a full disk and a read-only output."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file
from support.stage_helpers import train_config

from eagle3_train.cli import main as cli_main
from eagle3_train.data.prepare import prepare
from eagle3_train.hidden_states.extract import extract
from eagle3_train.train.trainer import train
from eagle3_train.utils.io import Eagle3InputError


def _poison_shard(path: Path) -> None:
    """Write NaN into a shard and update its index entry, as a verifier that overflowed would have stored it."""
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    tensors["aux"][2, :3] = float("nan")
    save_file(tensors, str(path), metadata=meta)
    index_path = path.parent / "index.json"
    index = json.loads(index_path.read_text())
    for e in index["shards"]:
        if e["file"] == path.name:
            e["sha256"], e["bytes"] = hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_size
    index_path.write_text(json.dumps(index))


@pytest.mark.slow
def test_nan_in_hidden_states_stops_training_naming_the_shard(tiny_stages, tmp_path):
    root, _ = tiny_stages
    hidden = tmp_path / "hidden"
    shutil.copytree(root / "hidden", hidden)
    shard = sorted((hidden / "train").glob("shard-*.safetensors"))[0]
    _poison_shard(shard)
    cfg = train_config(root, tmp_path / "run", hidden_states=str(hidden), epochs=1)
    with pytest.raises(Eagle3InputError, match=f"{shard.name}.*NaN/Inf.*eagle3-train extract"):
        train(cfg)  # before this check it trained to an all-NaN draft and exited 0


def test_extract_refuses_data_prepared_with_another_tokenizer(tiny_llama_dir, tmp_path):
    verifier = tiny_llama_dir()
    other = tmp_path / "other-verifier"
    shutil.copytree(verifier, other)
    tj = json.loads((other / "tokenizer.json").read_text())
    tj["added_tokens"].append({"id": 49151, "content": "<|x|>", "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": True})
    (other / "tokenizer.json").write_text(json.dumps(tj))
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"Q{i}?"},
                                                                    {"role": "assistant", "content": f"A{i}."}]})
                           + "\n" for i in range(4)))
    prepare(src, other, tmp_path / "prepared", val_count=1)
    with pytest.raises(Eagle3InputError, match="another tokenizer"):
        extract(tmp_path / "prepared", verifier, tmp_path / "hidden", dtype="float32")
    assert not (tmp_path / "hidden").exists()
    extract(tmp_path / "prepared", other, tmp_path / "hidden", dtype="float32")  # its own verifier is fine


def test_safetensors_write_failure_is_an_os_error_naming_the_file(tmp_path):
    """safetensors reports a failed write as SafetensorError; save_safetensors raises OSError(errno, file)."""
    target = tmp_path / "big.safetensors"
    code = ("import resource, torch; from eagle3_train.utils.io import save_safetensors\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))\n"
            "try:\n"
            f"    save_safetensors({{'x': torch.zeros(1 << 16)}}, {str(target)!r})\n"
            "except OSError as e:\n"
            "    print(e.errno, e.filename)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.stdout.split() == ["27", str(target)], r.stderr[-2000:]  # EFBIG: file too large


def _prepare_cmd(tmp_path: Path, verifier: Path, out: Path) -> list[str]:
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"Q{i}?" * 200},
                                                                    {"role": "assistant", "content": f"A{i}."}]})
                           + "\n" for i in range(40)))
    return [sys.executable, "-m", "eagle3_train.cli", "prepare", "--data", str(src), "--verifier", str(verifier),
            "--out", str(out), "--val-count", "1"]


@pytest.mark.slow
def test_cli_full_disk_is_a_clear_error(tiny_llama_dir, tmp_path):
    """A size limit on files (RLIMIT_FSIZE) makes writes fail as a full disk would: exit 2, no traceback."""
    cmd = _prepare_cmd(tmp_path, tiny_llama_dir(), tmp_path / "out")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit, timeout=600,
                       env={**os.environ, "EAGLE3_TRAIN_NO_PROGRESS": "1"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "cannot write" in r.stderr and "File too large" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_cli_read_only_output_is_a_clear_error(tiny_llama_dir, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        rc = cli_main(_prepare_cmd(tmp_path, tiny_llama_dir(), ro / "out")[3:])
    finally:
        ro.chmod(0o755)
    assert rc == 2 and "cannot write" in capsys.readouterr().err


def test_atomic_dir_removes_temp_dirs_a_kill_left(tmp_path):
    from eagle3_train.utils.outputs import atomic_dir, make_temp_dir

    target = tmp_path / "export-eagle"
    stale = make_temp_dir(target, "export")  # what a kill -9 in the middle of an export leaves
    (stale / "model.safetensors").write_bytes(b"half")
    with atomic_dir(target, "export") as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export-eagle"]
