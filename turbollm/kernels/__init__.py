"""C++ CPU kernels, compiled on first use with torch.utils.cpp_extension and cached.

`get_kernels()` returns the compiled CPU kernel module and `get_quant_kernels()` the
quantized-matmul module (csrc/quant_*.cpp, used by kernels/quant.py); each returns None when it
cannot be built (no compiler, no ninja, TURBOLLM_NO_KERNELS=1); callers then use the pure-PyTorch
reference beside each kernel, and one log line says so. The build lands in torch's extension cache
(~/.cache/torch_extensions), so only the first process pays the ~1 minute of compilation.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger("turbollm")
_lock = threading.Lock()
_state: dict[str, object] = {}
CSRC = Path(__file__).parent / "csrc"
_CPU_SOURCES = ("cpu_kernels_bindings.cpp", "paged_attention.cpp", "fused_ops.cpp")


def get_kernels():
    """The compiled kernel module, or None (reference paths are used instead)."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        module = None
        if os.environ.get("TURBOLLM_NO_KERNELS") != "1":
            try:
                from torch.utils.cpp_extension import load

                module = load(name="turbollm_cpu_kernels", sources=[str(CSRC / f) for f in _CPU_SOURCES],
                              extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                              verbose=False)
            except Exception as e:  # compiler missing, ninja missing, build error
                logger.warning("turbollm: C++ kernels unavailable (%s); using the PyTorch reference paths",
                               str(e).splitlines()[0] if str(e) else type(e).__name__)
        _state["module"] = module
        return module


_MISSING = object()


def cpu_kernels():
    """`get_kernels()` without the lock once the module is known: cheap enough for every forward."""
    module = _state.get("module", _MISSING)
    return get_kernels() if module is _MISSING else module


def get_quant_kernels():
    """The compiled quantized-matmul module (csrc/quant_*.cpp), or None (quant.py's references run).

    Separate from `get_kernels()` so that each module rebuilds only when its own sources change;
    TURBOLLM_NO_KERNELS=1 disables it as well. ``-ffp-contract=off`` keeps the dequantizers'
    multiply-then-add bit-exact with the PyTorch decoders.
    """
    with _lock:
        if "quant" in _state:
            return _state["quant"]
        module = None
        if os.environ.get("TURBOLLM_NO_KERNELS") != "1":
            try:
                from torch.utils.cpp_extension import load

                module = load(name="turbollm_quant_kernels", sources=[str(p) for p in sorted(CSRC.glob("quant_*.cpp"))],
                              extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                              extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:  # compiler missing, ninja missing, build error
                logger.warning("turbollm: quantized-matmul kernels unavailable (%s); using the PyTorch reference paths",
                               str(e).splitlines()[0] if str(e) else type(e).__name__)
        _state["quant"] = module
        return module
