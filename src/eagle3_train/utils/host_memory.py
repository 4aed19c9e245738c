"""Host memory of the compute-heavy stages (`eagle3-train train|extract|run`): which malloc serves them, how many
compiled matmul kernels oneDNN keeps, and handing freed heap pages back between CPU training steps.

Measured on 2 CPU cores, 100 bf16 training steps over batches of varying shape (benchmarks/README.md, "Memory"):
- glibc's malloc serves each step's large activations from fresh mmaps or a fragmenting heap: zeroed pages every step
  and an RSS that climbs for the whole run. Under tcmalloc, as PyTorch's CPU tuning guide advises, the same steps run
  ~1.5x faster and the heap grows less (vLLM's CPU backend preloads tcmalloc into its workers for the same reason).
  A library can only replace malloc before the process starts, so these stages re-execute themselves once with
  tcmalloc in LD_PRELOAD when it is installed (Debian/Ubuntu: libtcmalloc-minimal4; scripts/setup.sh installs it
  where apt can). Children (the vLLM servers, tools) get the user's LD_PRELOAD back. EAGLE3_TRAIN_MALLOC=system keeps
  the C library's malloc.
- oneDNN caches a compiled kernel per matmul shape, 1024 by default: every new batch shape adds entries that hold
  memory. 16 entries cost no speed there and cut the growth by a third (ONEDNN_PRIMITIVE_CACHE_CAPACITY, if set, wins).
- `train.release_host_memory`: malloc_trim after every step, for hosts that must stay on glibc (smaller RSS, ~7%
  slower).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

MALLOC_ENV = "EAGLE3_TRAIN_MALLOC"  # "system": keep the C library's malloc; "tcmalloc" in the re-executed process
_PRELOAD_BEFORE = "_EAGLE3_TRAIN_PRELOAD_BEFORE"
ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE = "16"
BUDGETED_STAGES = ("train", "extract", "run")


def tcmalloc_library() -> str | None:
    """The tcmalloc shared library the dynamic loader would preload, or None."""
    for name in ("tcmalloc_minimal", "tcmalloc"):
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def active_allocator() -> str:
    """'tcmalloc' when it serves this process's malloc, else 'system'."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "tcmalloc" if "libtcmalloc" in maps else "system"


def compute_env(base: Mapping[str, str]) -> dict[str, str]:
    """`base` with what a heavy stage runs best under: oneDNN's cache bounded and, on Linux where it is installed,
    tcmalloc preloaded (not when MALLOC_ENV is set or the user preloads an allocator of their own)."""
    env = dict(base)
    env.setdefault(ONEDNN_CACHE_ENV, ONEDNN_CACHE)
    preload = env.get("LD_PRELOAD", "")
    if env.get(MALLOC_ENV) or not sys.platform.startswith("linux") or "malloc" in preload:
        return env
    lib = tcmalloc_library()
    if lib is not None:
        env.update({MALLOC_ENV: "tcmalloc", _PRELOAD_BEFORE: preload, "LD_PRELOAD": f"{lib} {preload}".strip()})
    return env


def prepare_process(stage: str | None, argv: list[str]) -> None:
    """At the start of an `eagle3-train` process: restore the children's environment after a re-exec; for a heavy
    stage, take `compute_env`, re-executing under tcmalloc (never returns then) where it adds the preload."""
    if _PRELOAD_BEFORE in os.environ:
        before = os.environ.pop(_PRELOAD_BEFORE)
        if before:
            os.environ["LD_PRELOAD"] = before
        else:
            os.environ.pop("LD_PRELOAD", None)
    if stage not in BUDGETED_STAGES:
        return
    env = compute_env(os.environ)
    if env.get("LD_PRELOAD", "") == os.environ.get("LD_PRELOAD", ""):
        os.environ.update(env)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "eagle3_train.cli", *argv], env)


def malloc_trim() -> Callable[[], None] | None:
    """A call that hands glibc's free heap pages back to the OS, or None where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def release() -> None:
        trim(0)

    return release
