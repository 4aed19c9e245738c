"""Hand freed host memory back to the OS between CPU training steps.

glibc's malloc raises its mmap threshold to the size of the largest block it has freed, so after the first steps the
activations of a step (megabytes each, a different shape in every batch) come from the heap, and the holes that
batches of other shapes leave there are kept: anonymous RSS climbs for the whole run (benchmarks/README.md, "Memory").
`malloc_trim(0)` after a step returns the free pages of every arena without changing how malloc serves the next one.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable


def malloc_trim() -> Callable[[], None] | None:
    """A call that releases glibc's free heap pages, or None where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def release() -> None:
        trim(0)

    return release
