"""C++ CPU kernels, compiled on first use with torch.utils.cpp_extension and cached.

`get_kernels()` returns the compiled module, or None when it cannot be built (no compiler,
no ninja, TURBOLLM_NO_KERNELS=1); callers then use the pure-PyTorch reference beside each
kernel, and one log line says so. The build lands in torch's extension cache
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


def get_kernels():
    """The compiled kernel module, or None (reference paths are used instead)."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        module = None
        if os.environ.get("TURBOLLM_NO_KERNELS") != "1":
            try:
                from torch.utils.cpp_extension import load

                module = load(name="turbollm_cpu_kernels", sources=[str(CSRC / "paged_attention.cpp")],
                              extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                              verbose=False)
            except Exception as e:  # compiler missing, ninja missing, build error
                logger.warning("turbollm: C++ kernels unavailable (%s); using the PyTorch reference paths",
                               str(e).splitlines()[0] if str(e) else type(e).__name__)
        _state["module"] = module
        return module
