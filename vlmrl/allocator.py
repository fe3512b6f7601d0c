"""CPU memory allocation for large tensors: keep freed memory for reuse instead of returning it to the kernel.

glibc serves every allocation above its mmap threshold (128 KiB, rising to at most 32 MiB) with a fresh `mmap` and
returns it with `munmap` when freed. A sampling step over a real vocabulary allocates and frees several
[rows, 151,936] float32 tensors (~78 MB each for 128 rows), so every decoded token pays for hundreds of MB of fresh
pages that the kernel must zero: measured here, most of the step's CPU time went to the kernel (`sys`), not to
math. Raising the mmap and trim thresholds makes glibc keep freed blocks in its heap and hand them out again, as
PyTorch's CUDA caching allocator does on GPUs.

The price is memory: blocks of many sizes share the heap, it fragments, and nothing is returned until the process
ends. Measured with a 151,936-token vocabulary and the 16 x 8 batch (BENCHMARKS.md): steps 2.0-2.4x faster, peak
resident memory 2.4-4x higher (6.4 GB instead of 1.6 GB at 48 new tokens). So it is off by default: set
`VLMRL_MALLOC_REUSE=1` when speed on a CPU matters more than memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (see the module docstring); True when applied."""
    if os.environ.get("VLMRL_MALLOC_REUSE", "0") != "1" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1))
