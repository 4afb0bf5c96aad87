"""C++ CPU kernels, compiled on first use with torch.utils.cpp_extension and cached.

One extension, ``turbollm_kernels``, is built from every ``csrc/*.cpp``: decode attention,
the fused element-wise ops, the quantized matmuls and the fused decode step (which calls the
others without Python, so they must live in one module). `get_kernels()` returns it (and
`get_quant_kernels()`, the name kernels/quant.py uses, the same module), or None when it cannot be
built (no compiler, no ninja, TURBOLLM_NO_KERNELS=1); callers then use the pure-PyTorch reference
beside each kernel, and one log line says so. ``-ffp-contract=off`` keeps the dequantizers'
multiply-then-add bit-exact with the PyTorch decoders (the other kernels write their FMAs as
intrinsics).

Builds land in ``~/.cache/turbollm/kernels/<module>`` (``TURBOLLM_KERNEL_CACHE`` moves it), so
only the first process pays the ~2-3 minutes of compilation. Concurrent processes serialise on an
``flock`` that the OS drops when its holder dies; torch's own ``lock`` file in the build folder
(which a killed build leaves behind and which would make every later build wait forever) is
removed under that lock before building.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger("turbollm")
_lock = threading.Lock()
_state: dict[str, object] = {}
CSRC = Path(__file__).parent / "csrc"


def kernel_cache_root() -> Path:
    """Where compiled kernel modules live: $TURBOLLM_KERNEL_CACHE or ~/.cache/turbollm/kernels."""
    env = os.environ.get("TURBOLLM_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "turbollm" / "kernels"


@contextlib.contextmanager
def locked_build_dir(name: str, root: Path | None = None):
    """Yield ``root/name`` while holding an exclusive flock on it, stale torch baton removed.

    The flock is released by the kernel when the holding process exits, killed or not, so a
    crashed build never blocks the next one. While we hold it no other turbollm process is in
    torch's build for this folder, so a leftover ``lock`` file there can only be stale.
    """
    import fcntl

    build_dir = (root or kernel_cache_root()) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".turbollm-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            baton = build_dir / "lock"
            if baton.exists():
                logger.warning("turbollm: removing a stale build lock left by a killed build: %s", baton)
                baton.unlink()
            yield build_dir
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(name: str, sources: list[str], cflags: list[str], what: str):
    """Compile (or load the cached) extension `name`; None, with one warning, when that fails."""
    if os.environ.get("TURBOLLM_NO_KERNELS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        with locked_build_dir(name) as build_dir:
            return load(name=name, sources=sources, extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                        build_directory=str(build_dir), verbose=False)
    except Exception as e:  # compiler missing, ninja missing, build error, unwritable cache
        logger.warning("turbollm: %s unavailable (%s); using the PyTorch reference paths",
                       what, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


def get_kernels():
    """The compiled kernel module, or None (reference paths are used instead)."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build("turbollm_kernels", [str(p) for p in sorted(CSRC.glob("*.cpp"))],
                                      ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"], "C++ kernels")
        return _state["module"]


_MISSING = object()


def cpu_kernels():
    """`get_kernels()` without the lock once the module is known: cheap enough for every forward."""
    module = _state.get("module", _MISSING)
    return get_kernels() if module is _MISSING else module


def get_quant_kernels():
    """The module holding the quantized matmuls (csrc/quant_*.cpp): the same one as `get_kernels()`."""
    return get_kernels()
