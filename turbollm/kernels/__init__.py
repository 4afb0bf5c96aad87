"""C++ CPU kernels, compiled on first use with torch.utils.cpp_extension and cached.

One extension, ``turbollm_kernels``, is built from every ``csrc/*.cpp``: decode attention,
the fused element-wise ops, the quantized matmuls and the fused decode step (which calls the
others without Python, so they must live in one module). `get_kernels()` returns it (and
`get_quant_kernels()`, the name kernels/quant.py uses, the same module), or None when it cannot be
built (no compiler, no ninja, TURBOLLM_NO_KERNELS=1); callers then use the pure-PyTorch reference
beside each kernel, and one log line says so (`build_error()` keeps the reason, for tests to print).
``-ffp-contract=off`` keeps the dequantizers' multiply-then-add bit-exact with the PyTorch decoders
(the other kernels write their FMAs as intrinsics).

Builds land in ``~/.cache/turbollm/kernels/<module>-<key>`` (``TURBOLLM_KERNEL_CACHE`` moves the
root), the key a hash of the sources' names and bytes, the flags, the torch and Python versions,
where torch is installed, as the path reads (torch's header and library paths are part of every compile
and link command, so each environment, and each path to one through a symlink, needs its own build) and
the CPU's feature flags (`arch_flags`: the module is compiled for x86-64-v3 and tuned for this CPU, the
AVX-512 / AMX kernel forms added by target pragmas in their own files and chosen at run time,
`kernels/forms.py`; elsewhere ``-march=native``: a cache shared between machines must not hand one CPU's
instructions to another).
The sources are copied into that folder and compiled from there: checkouts of the same code under
one environment share a build, a working checkout and a clean clone with its own venv (CI) each keep
theirs instead of recompiling each other's every time they alternate, and a checkout with other
sources never overwrites a module another process has loaded. Only the first process for a given key
pays the compilation (about 6 minutes on 2 cores; one warning line says it is happening and another
how long it took). The `KEEP_BUILDS` most recently used folders are kept, and a folder a live process
has loaded is never removed: each loader holds a shared ``flock`` on ``IN_USE_LOCK`` in its folder
for its lifetime. Concurrent builds serialise on an exclusive ``flock`` on ``BUILD_LOCK``; the OS
drops both when their holder dies. torch's own ``lock`` file in the build folder (which a killed
build leaves behind and which would make every later build wait forever) is removed under the build
lock before building.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger("turbollm")
_lock = threading.Lock()
_state: dict[str, object] = {}
CSRC = Path(__file__).parent / "csrc"
KEEP_BUILDS = 4
BUILD_LOCK = ".turbollm-build.lock"  # in each build folder: the build flock, and its mtime = last used
IN_USE_LOCK = ".turbollm-in-use.lock"  # in each build folder: shared flocks held by the processes using it
CPUINFO = Path("/proc/cpuinfo")


def kernel_cache_root() -> Path:
    """Where compiled kernel modules live: $TURBOLLM_KERNEL_CACHE or ~/.cache/turbollm/kernels."""
    env = os.environ.get("TURBOLLM_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "turbollm" / "kernels"


def cpu_flags(cpuinfo: Path | None = None) -> str:
    """The CPU's instruction-set features, as one sorted, space-separated string.

    On Linux the ``flags`` (x86) or ``Features`` (ARM) line of /proc/cpuinfo, sorted and
    de-duplicated: that is the CPUID feature set ``-march=native`` is derived from, read from a file
    in microseconds. ``gcc -march=native -Q --help=target`` would give the compiler's resolved
    target exactly, but spawns a compiler (tens of ms) in every process that loads the cached
    module; flags over-separate at worst (a VM flag such as ``hypervisor`` costs one extra build,
    never a wrong one). Elsewhere (no /proc): the machine and processor names from `platform`.
    """
    try:
        for line in (cpuinfo or CPUINFO).read_text(errors="replace").splitlines():
            field, _, value = line.partition(":")
            if field.strip() in ("flags", "Features"):
                return " ".join(sorted(set(value.split())))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


@contextlib.contextmanager
def locked_build_dir(name: str, root: Path | None = None):
    """Yield ``root/name`` while holding an exclusive flock on it, stale torch baton removed.

    Taking it marks the folder as used now (the lock file's mtime, which `prune_builds` reads).
    The flock is released by the kernel when the holding process exits, killed or not, so a
    crashed build never blocks the next one. While we hold it no other turbollm process is in
    torch's build for this folder, so a leftover ``lock`` file there can only be stale.
    """
    import fcntl

    build_dir = (root or kernel_cache_root()) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / BUILD_LOCK, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            logger.warning("turbollm: waiting for another process that builds or loads the C++ kernels in %s",
                           build_dir)
            fcntl.flock(handle, fcntl.LOCK_EX)
        os.utime(handle.fileno())
        try:
            baton = build_dir / "lock"
            if baton.exists():
                logger.warning("turbollm: removing a stale build lock left by a killed build: %s", baton)
                baton.unlink()
            yield build_dir
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def mark_in_use(build_dir: Path):
    """Hold a shared flock on ``build_dir/IN_USE_LOCK`` until this process exits (the handle lives in
    module state), so that `prune_builds` in any process leaves the folder alone.

    Take it while holding the build lock, before loading: `prune_builds` checks this lock only under
    the build lock, so there is no moment where the module is mapped and the folder looks unused. It
    is a separate file because a lifetime hold on the build lock would block every later
    `locked_build_dir` for the same key (every other process loading the same build) forever.
    """
    import fcntl

    handle = open(build_dir / IN_USE_LOCK, "a")
    fcntl.flock(handle, fcntl.LOCK_SH)
    _state.setdefault("in_use", []).append(handle)  # type: ignore[union-attr]
    return handle


def release_in_use(handle) -> None:
    """Drop a hold `mark_in_use` took (the module it was for did not load)."""
    held = _state.get("in_use", [])
    if handle in held:  # type: ignore[operator]
        held.remove(handle)  # type: ignore[union-attr]
    handle.close()


def build_key(files: list[Path], cflags: list[str]) -> str:
    """16 hex digits naming a build: the files' names and bytes, the flags, torch's version and install
    folder, Python's version and the CPU's feature flags (`cpu_flags`)."""
    import torch

    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        data = path.read_bytes()
        digest.update(f"{path.name}\0{len(data)}\0".encode())
        digest.update(data)
    # as written, not resolved: torch's cpp_extension puts this path into build.ninja, so two paths to one venv
    # (a symlinked .venv) sharing a folder would rebuild every object each time they alternate
    torch_dir = str(Path(torch.__file__).parent)
    digest.update("\0".join([*cflags, torch.__version__, torch_dir, sys.version, cpu_flags()]).encode())
    return digest.hexdigest()[:16]


def stage_sources(files: list[Path], build_dir: Path) -> list[Path]:
    """Copy `files` into ``build_dir/src`` (rewriting only what differs); the copies, in order."""
    src = build_dir / "src"
    src.mkdir(exist_ok=True)
    staged = []
    for path in files:
        target = src / path.name
        data = path.read_bytes()
        if not target.exists() or target.read_bytes() != data:
            target.write_bytes(data)
        staged.append(target)
    return staged


def _free(handle) -> bool:
    """Whether a non-blocking exclusive flock on the open file `handle` succeeds."""
    import fcntl

    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def prune_builds(name: str, root: Path, keep: int = KEEP_BUILDS) -> list[Path]:
    """Remove all but the `keep` most recently used ``name-*`` build folders (and a pre-key ``name``
    folder), skipping any that another process is building in (build lock held) or has loaded
    (a shared in-use lock held); the folders removed."""
    folders = [p for p in root.glob(f"{name}-*") if p.is_dir()]
    folders.sort(key=lambda p: (p / BUILD_LOCK if (p / BUILD_LOCK).exists() else p).stat().st_mtime, reverse=True)
    stale = folders[keep:] + [p for p in [root / name] if p.is_dir()]
    removed = []
    for folder in stale:
        with open(folder / BUILD_LOCK, "a") as build, open(folder / IN_USE_LOCK, "a") as in_use:
            if not (_free(build) and _free(in_use)):
                continue  # being built, or loaded by a live process
            shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def summarize_error(error: BaseException, max_lines: int = 20) -> str:
    """The exception's first line and its lines that mention an error (a compiler's diagnostics sit
    deep in torch's build output), at most `max_lines`, each clipped to 300 characters."""
    lines = [line for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    picked = [lines[0]] + [line for line in lines[1:] if "error" in line.lower()]
    return "\n".join(line[:300] for line in (picked if len(picked) > 1 else lines)[:max_lines])


def build_error() -> str | None:
    """Why `get_kernels()` returned None (None while it has not been called or the build worked)."""
    return _state.get("error")  # type: ignore[return-value]


def _build(name: str, sources: list[Path], headers: list[Path], cflags: list[str], what: str):
    """Compile (or load the cached) extension `name` from `sources` (which include `headers`); None,
    with one warning and the reason in `build_error()`, when that fails."""
    _state.pop("error", None)
    if os.environ.get("TURBOLLM_NO_KERNELS") == "1":
        _state["error"] = "kernels disabled by TURBOLLM_NO_KERNELS=1"
        return None
    try:
        from torch.utils.cpp_extension import load

        key = build_key([*sources, *headers], cflags)
        with locked_build_dir(f"{name}-{key}") as build_dir:
            staged = stage_sources([*sources, *headers], build_dir)[:len(sources)]
            compiling = not (build_dir / f"{name}.so").exists()  # else torch's load only loads it
            if compiling:
                logger.warning("turbollm: compiling the %s into %s (first use for this version, environment "
                               "and CPU; about 6 minutes on 2 cores)...", what, build_dir)
                start = time.monotonic()
            hold = mark_in_use(build_dir)
            try:
                module = load(name=name, sources=[str(p) for p in staged], extra_cflags=cflags,
                              extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
            except BaseException:
                release_in_use(hold)
                raise
            if compiling:
                logger.warning("turbollm: %s compiled in %.0f s", what, time.monotonic() - start)
        try:
            prune_builds(name, kernel_cache_root())
        except OSError as e:  # housekeeping only: the module is loaded whatever happens here
            logger.debug("turbollm: could not prune old kernel builds: %s", e)
        return module
    except Exception as e:  # compiler missing, ninja missing, build error, unwritable cache
        _state["error"] = summarize_error(e)
        logger.warning("turbollm: %s unavailable (%s); using the PyTorch reference paths",
                       what, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


#: x86-64 features every kernel form needs (x86-64-v3, the AVX2 form): the module is compiled for
#: them, and the wider forms' translation units add their own (a target pragma), so that one build
#: holds every form and picks one at run time from the CPU it runs on (`turbollm.kernels.forms`).
BASE_X86_FEATURES = frozenset({"avx2", "fma", "f16c", "bmi2"})


def arch_flags(flags: str | None = None) -> list[str]:
    """The module's target: x86-64-v3 (the AVX2 form; the AVX-512 forms compile on top of it) on an
    x86-64 CPU that has it, else the compiler's native target (another architecture, or an x86 CPU
    without AVX2: the portable C++ paths)."""
    have = set((flags if flags is not None else cpu_flags()).split())
    if platform.machine() in ("x86_64", "AMD64") and BASE_X86_FEATURES <= have:
        return ["-march=x86-64-v3", "-mtune=native"]
    return ["-march=native"]


def get_kernels():
    """The compiled kernel module, or None (reference paths are used instead)."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build("turbollm_kernels", sorted(CSRC.glob("*.cpp")), sorted(CSRC.glob("*.h")),
                                      ["-O3", *arch_flags(), "-fopenmp", "-ffp-contract=off"], "C++ kernels")
        return _state["module"]


_MISSING = object()


def cpu_kernels():
    """`get_kernels()` without the lock once the module is known: cheap enough for every forward."""
    module = _state.get("module", _MISSING)
    return get_kernels() if module is _MISSING else module


def get_quant_kernels():
    """The module holding the quantized matmuls (csrc/quant_*.cpp): the same one as `get_kernels()`."""
    return get_kernels()
