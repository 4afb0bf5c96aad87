"""Keep glibc from returning large freed buffers to the OS after every step.

A forward pass allocates and frees many tensors of several MB. By default glibc serves
those with fresh mmaps and unmaps them on free, so every step pays page faults for the
same memory again (we measured several minutes of system time in a 130-step benchmark).
Raising the mmap and trim thresholds lets the heap keep and reuse that memory. Once, after the
model is loaded and the K/V storage allocated, `release_heap` gives back what loading freed
(dequantization and repacking buffers: ~170 MiB for qwen2.5-coder-0.5b), so the resident size is
then the weights, the runtime and what the steps use, not what loading happened to leave behind.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_done = False


def tune_malloc(threshold_bytes: int = 1 << 30) -> bool:
    """Apply once per process; returns True when glibc accepted the settings."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, min(threshold_bytes, 1 << 30)) == 1
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, threshold_bytes) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        logging.getLogger("turbollm").debug("mallopt not available; large buffers are not kept")
    _done = ok
    return ok


def release_heap() -> bool:
    """Return the heap's free memory to the OS (glibc's malloc_trim); whether it released any."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False
