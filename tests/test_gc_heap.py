"""freeze_startup_heap: what is alive after start-up leaves the collector's full passes; what serving makes
later (cycles included) is still collected. In a child process: freezing is process-wide."""

import json
import subprocess
import sys

CHILD = """
import gc, json, time
from turbollm.gc_heap import freeze_startup_heap
keep = [[i] for i in range(200_000)]  # long-lived start-up objects, all tracked by the collector
t0 = time.perf_counter(); gc.collect(); before_s = time.perf_counter() - t0
before = len(gc.get_objects())
frozen = freeze_startup_heap()
after = len(gc.get_objects())
t0 = time.perf_counter(); gc.collect(); after_s = time.perf_counter() - t0
cycle = []; cycle.append(cycle); del cycle  # made after start-up: a full pass still finds it
print(json.dumps({"before": before, "frozen": frozen, "after": after, "collected": gc.collect(),
                  "before_s": before_s, "after_s": after_s}))
"""


def test_start_up_objects_leave_full_collections_and_later_cycles_are_still_collected():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["frozen"] >= 200_000 and r["before"] >= 200_000
    assert r["after"] < r["before"] // 20  # what a full pass walks now
    assert r["after_s"] < r["before_s"]
    assert r["collected"] >= 1
