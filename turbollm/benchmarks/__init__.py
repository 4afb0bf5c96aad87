"""Benchmarks behind `turbollm bench throughput` and `turbollm bench latency`.

Each run prints its full setting, then its results with the physics: achieved memory
bandwidth (weight bytes read per step × steps/s) and compute (GFLOP/s from the matmul
parameter count), against the machine's ceilings (`physics.py`).

- `physics.py`: machine ceilings, what one forward step reads and computes, the arithmetic.
- `datasets.py`: benchmark requests (ShareGPT prompts, random token ids).
- `step_stats.py`: per-step timing and batch composition of a running engine.
- `throughput.py`: offline throughput of turbollm (`LLM.generate` on all requests at once).
- `hf_backend.py`: the same requests through transformers `generate` in static batches.
- `latency.py`: time to first token and per-token decode latency through the step loop.
- `report.py`: the setting block, result printing and the JSON file.
"""
