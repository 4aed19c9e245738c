"""malloc_trim between CPU training steps: it really hands freed heap pages back, and it changes no result."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from stage_helpers import train_config

from eagle3_train.train.host_memory import malloc_trim
from eagle3_train.train.trainer import train

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
    plain = train(train_config(root, tmp_path / "plain", max_steps=4))
    trimmed = train(train_config(root, tmp_path / "trimmed", max_steps=4, release_host_memory=True))
    a = load_file(str(tmp_path / "plain" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "trimmed" / "final" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    assert plain["train"]["loss"] == trimmed["train"]["loss"]
