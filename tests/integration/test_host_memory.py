"""Host memory of CPU training: malloc_trim really hands freed heap pages back and changes no result; the heavy
stages run under tcmalloc where it is installed, recorded in the training metadata, without passing it on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.stage_helpers import train_config

from eagle3_train.train.trainer import Trainer, train
from eagle3_train.utils.host_memory import (
    MALLOC_ENV,
    ONEDNN_CACHE_ENV,
    compute_env,
    malloc_trim,
    tcmalloc_library,
)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim is Linux-only")


def rss_anon_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


@linux_only
def test_malloc_trim_returns_freed_heap_pages_to_the_os():
    release = malloc_trim()
    assert release is not None
    # 2,000 blocks of 48 KiB come from the heap (below glibc's mmap threshold); the last one stays alive and pins the
    # top of the heap, so free() alone keeps the ~94 MiB below it resident.
    blocks = [bytearray(48 * 1024) for _ in range(2000)]
    for b in blocks:
        b[::4096] = b"\x01" * len(b[::4096])  # touch every page
    keep = blocks.pop()
    before_free = rss_anon_kb()
    del blocks
    after_free = rss_anon_kb()
    release()
    after_trim = rss_anon_kb()
    assert keep[0] == 1
    assert after_trim < after_free - 50 * 1024, (before_free, after_free, after_trim)


@linux_only
@pytest.mark.slow
def test_release_host_memory_changes_no_result(tiny_stages, tmp_path):
    root, _ = tiny_stages
    trimming = Trainer(train_config(root, tmp_path / "probe", max_steps=4, release_host_memory=True))
    assert trimming.release_host_memory is not None  # the option really installs the per-step trim on this host
    for data in (trimming.train_data, trimming.val_data):
        if data is not None:
            data.close()
    plain = train(train_config(root, tmp_path / "plain", max_steps=4))
    trimmed = train(train_config(root, tmp_path / "trimmed", max_steps=4, release_host_memory=True))
    a = load_file(str(tmp_path / "plain" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "trimmed" / "final" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    assert plain["train"]["loss"] == trimmed["train"]["loss"]


def _cli_train(root: Path, out: Path, env: dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", "eagle3_train.cli", "train", "--prepared", str(root / "prepared"),
           "--hidden-states", str(root / "hidden"), "--vocab", str(root / "vocab"), "--out", str(out),
           "--ttt-steps", "2", "--token-budget", "512", "--max-steps", "2", "--set", "train.tensorboard=false"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "final" / "training_metadata.json").read_text())["run"]


@linux_only
@pytest.mark.slow
def test_train_command_runs_under_tcmalloc_and_children_do_not_inherit_it(tiny_stages, tmp_path):
    if tcmalloc_library() is None:
        pytest.skip("libtcmalloc is not installed (apt-get install libtcmalloc-minimal4)")
    root, _ = tiny_stages
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", MALLOC_ENV)}
    assert _cli_train(root, tmp_path / "tc", env)["host_malloc"] == "tcmalloc"
    assert _cli_train(root, tmp_path / "sys", {**env, MALLOC_ENV: "system"})["host_malloc"] == "system"


def _after_prepare(stage: str, env: dict[str, str]) -> list[str]:
    probe = ("import os, sys; from eagle3_train.utils.host_memory import prepare_process; "
             f"prepare_process({stage!r}, []); print(repr(os.environ.get('LD_PRELOAD'))); "
             f"print(repr(os.environ.get({ONEDNN_CACHE_ENV!r})))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()


@linux_only
def test_children_get_the_users_preload_back_and_light_stages_are_left_alone():
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", MALLOC_ENV, ONEDNN_CACHE_ENV)}
    lib = tcmalloc_library() or "libtcmalloc_minimal.so.4"
    # what a re-executed process sees: ours dropped, the user's own preload restored, the oneDNN bound kept
    reexecuted = {**env, MALLOC_ENV: "tcmalloc", "LD_PRELOAD": lib, "_EAGLE3_TRAIN_PRELOAD_BEFORE": ""}
    assert _after_prepare("train", reexecuted) == ["None", "'16'"]
    with_user_preload = {**reexecuted, "LD_PRELOAD": f"{lib} libuser.so", "_EAGLE3_TRAIN_PRELOAD_BEFORE": "libuser.so"}
    assert _after_prepare("train", with_user_preload) == ["'libuser.so'", "'16'"]
    # a light stage changes nothing; a bound the user set wins
    assert _after_prepare("vocab", env) == ["None", "None"]
    assert _after_prepare("extract", {**env, MALLOC_ENV: "system", ONEDNN_CACHE_ENV: "64"}) == ["None", "'64'"]


def test_compute_env_respects_a_users_allocator_and_the_opt_out():
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", MALLOC_ENV, ONEDNN_CACHE_ENV)}
    own = compute_env({**base, "LD_PRELOAD": "/usr/lib/libjemalloc.so.2"})
    assert own["LD_PRELOAD"] == "/usr/lib/libjemalloc.so.2" and own[ONEDNN_CACHE_ENV] == "16"
    assert "LD_PRELOAD" not in compute_env({**base, MALLOC_ENV: "system"})
    chosen = compute_env(base)
    lib = tcmalloc_library()
    if lib is not None and sys.platform.startswith("linux"):
        assert chosen["LD_PRELOAD"] == lib and chosen[MALLOC_ENV] == "tcmalloc"
    else:
        assert "LD_PRELOAD" not in chosen
