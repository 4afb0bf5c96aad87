"""Where a decode step's time goes, host against kernels (issue 46, item 4): the fused layers, the LM head, the
sampler, and the rest of the host's work (scheduling, batch building, updates, output processing), timed with
perf_counter around the runner's calls (no profiler: it inflates the Python), 60 steps after 5 warm-up ones.

    python scripts/host_share.py MODEL BATCH [--qmatmul fast]

Prints one line: the step's milliseconds split four ways and the host's share (sampling included).
"""

import argparse
import time

from turbollm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("batch", type=int)
    ap.add_argument("--qmatmul", default="fast")
    ap.add_argument("--steps", type=int, default=60)
    ns = ap.parse_args()
    llm = LLM(ns.model, threads=2, qmatmul=ns.qmatmul, max_num_seqs=max(64, ns.batch))
    eng = llm.engine
    runner = eng.executor.worker.runner
    acc = {"layers": 0.0, "logits": 0.0, "sample": 0.0}

    def wrap(obj, name, key):
        f = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            r = f(*a, **k)
            acc[key] += time.perf_counter() - t
            return r
        setattr(obj, name, timed)

    wrap(runner, "run_layers", "layers")
    wrap(runner.model, "compute_logits", "logits")
    wrap(runner.sampler, "sample", "sample")
    params = SamplingParams(temperature=0, max_tokens=ns.steps + 10, ignore_eos=True)
    for i in range(ns.batch):
        eng.add_request({"prompt_token_ids": [(13 * i + j) % 2000 + 50 for j in range(128)]}, params)
    for _ in range(5):
        eng.step()
    acc.update(dict.fromkeys(acc, 0.0))
    t0 = time.perf_counter()
    for _ in range(ns.steps):
        eng.step()
    tot = (time.perf_counter() - t0) / ns.steps * 1000
    per = {k: v / ns.steps * 1000 for k, v in acc.items()}
    host = tot - per["layers"] - per["logits"] - per["sample"]
    print(f"{ns.model} batch {ns.batch} (qmatmul {ns.qmatmul}, 2 threads): step {tot:.2f} ms = layers "
          f"{per['layers']:.2f} + LM head {per['logits']:.2f} + sampling {per['sample']:.2f} + the rest of the host "
          f"{host:.2f} ms; host incl. sampling {(host + per['sample']) / tot * 100:.1f}%")


if __name__ == "__main__":
    main()
