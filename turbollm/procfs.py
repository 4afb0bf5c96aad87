"""Whether a process is alive, and what /proc says of it (Linux): its state and the CPU time it used (None
where /proc cannot be read)."""

from __future__ import annotations

import os


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # clock ticks per second (the unit of /proc's CPU times)


def _stat_fields(path: str) -> list[str] | None:
    """A stat file of /proc after the command name (state first), or None when it cannot be read."""
    try:
        with open(path) as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def _ticks(fields: list[str] | None) -> int | None:
    """User + system CPU time in a stat file's fields, in clock ticks."""
    try:
        return int(fields[11]) + int(fields[12]) if fields else None
    except (ValueError, IndexError):
        return None


def proc_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (state first), or None when it cannot be read."""
    return _stat_fields(f"/proc/{pid}/stat")


def cpu_ticks(pid: int) -> int | None:
    """User + system CPU time of process `pid`, in clock ticks (None when it cannot be read)."""
    return _ticks(proc_fields(pid))


def proc_state(pid: int) -> str | None:
    fields = proc_fields(pid)
    return fields[0] if fields else None


PF_EXITING = 0x4  # the process flag set as a process starts to end (its memory and files still being released)


def proc_exiting(pid: int) -> bool:
    """Whether process `pid` is ending (killed: it may hold its sockets open a while longer)."""
    fields = proc_fields(pid)
    try:
        return bool(fields and int(fields[6]) & PF_EXITING)
    except (ValueError, IndexError):
        return False


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (one that is gone, its parent not yet told)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    return proc_state(pid) != "Z"


def threads_cpu_s(exclude: set[int]) -> float:
    """User + system CPU time of this process's threads but those with native ids in `exclude`, in seconds
    (a thread that has ended no longer counts)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    ticks = (_ticks(_stat_fields(f"/proc/self/task/{tid}/stat")) for tid in tids if int(tid) not in exclude)
    return sum(t for t in ticks if t is not None) / CLOCK_TICKS


def _kib_field(path: str, key: str) -> int | None:
    """The `key:` line of a /proc file that counts in kB (status, meminfo), in bytes; None when it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_bytes() -> int:
    """This process's resident set (VmRSS) in bytes, or 0 when /proc cannot be read."""
    return _kib_field("/proc/self/status", "VmRSS") or 0


def available_memory(default: int = 8 << 30) -> int:
    """The memory the kernel says new work can take without swapping (MemAvailable), or `default`."""
    avail = _kib_field("/proc/meminfo", "MemAvailable")
    return default if avail is None else avail


def descendants(pid: int | None = None) -> list[int]:
    """The live processes below `pid` (default: this one), children first."""
    root = os.getpid() if pid is None else pid
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = proc_fields(int(name))
            if fields and len(fields) > 1 and fields[1].isdigit():
                parent[int(name)] = int(fields[1])
    out, frontier = [], [root]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


def peak_rss_bytes(pid: int | None = None) -> int:
    """The peak resident set (VmHWM) of `pid` (default: this process) in bytes, or 0 when it cannot be read."""
    return _kib_field(f"/proc/{'self' if pid is None else pid}/status", "VmHWM") or 0


def reset_peak_rss(pid: int | None = None) -> None:
    """Start `pid`'s (default: this process's) peak resident set again from its present size (Linux's
    clear_refs 5); OSError when /proc does not let us."""
    with open(f"/proc/{'self' if pid is None else pid}/clear_refs", "w") as f:
        f.write("5")


def reset_tree_peak(pid: int | None = None) -> None:
    """`reset_peak_rss` for `pid` (default: this process) and its descendants, so a later `tree_peak_bytes` sees
    only what came after (a process that does not let us keeps its peak)."""
    for p in [os.getpid() if pid is None else pid] + descendants(pid):
        try:
            reset_peak_rss(p)
        except OSError:
            pass


def tree_peak_bytes(pid: int | None = None) -> int:
    """The peak resident sets (VmHWM) of `pid` (default: this process) and every live process below it, summed:
    the most memory an engine and its worker processes held, each at its own peak."""
    return sum(peak_rss_bytes(p) for p in [os.getpid() if pid is None else pid] + descendants(pid))
