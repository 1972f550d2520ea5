"""Keep freed CPU memory in the process: the CPU's counterpart of PyTorch's CUDA caching allocator.

glibc's malloc serves every block of 32 MiB or more with a fresh mmap and unmaps it on free, and
trims the heap's free top back to the kernel. A training step on the CPU allocates the same large
tensors every step (hidden rows, expert gradients, pulled shadow copies), so each step pays a
first-touch page fault per 4 KiB page, which on a VM is most of a step's fixed cost. With
`keep_freed_memory()` malloc takes every block from its heap and never trims it: the next step
reuses the pages it already touched. The price is that the process keeps its peak memory.

It changes the whole process (any allocation, not only fmoe's), so it is never done on import:
call it first thing in a training script (`fmoe train --keep-freed-memory` does), or set glibc's
own MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<large> before Python starts, which is the same.
"""
import ctypes
import ctypes.util

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# glibc's defaults, for restore().
_DEFAULT_MMAP_MAX = 65536
_DEFAULT_TRIM_THRESHOLD = 128 * 1024
_NEVER_TRIM = 2 ** 31 - 1        # mallopt takes an int: trim only a free top past 2 GiB


def _libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def available() -> bool:
    """Whether this process's C library is glibc, whose malloc these settings are for."""
    return _libc() is not None


def _set(mmap_max: int, trim_threshold: int):
    libc = _libc()
    if libc is None:
        raise RuntimeError("keep_freed_memory: this process's C library is not glibc (no mallopt to tune)")
    if not libc.mallopt(_M_MMAP_MAX, ctypes.c_int(mmap_max)):
        raise RuntimeError(f"keep_freed_memory: mallopt(M_MMAP_MAX, {mmap_max}) refused")
    if not libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(trim_threshold)):
        libc.mallopt(_M_MMAP_MAX, ctypes.c_int(_DEFAULT_MMAP_MAX))      # leave things as they were
        raise RuntimeError("keep_freed_memory: mallopt(M_TRIM_THRESHOLD) refused")


def keep_freed_memory():
    """From now on malloc keeps freed blocks for reuse (no mmap per large block, no heap trim).
    RuntimeError, with nothing changed, where the C library is not glibc."""
    _set(0, _NEVER_TRIM)


def restore():
    """glibc's default values again, for blocks allocated from now on (its dynamic mmap
    threshold, which any mallopt switches off, stays off)."""
    _set(_DEFAULT_MMAP_MAX, _DEFAULT_TRIM_THRESHOLD)
