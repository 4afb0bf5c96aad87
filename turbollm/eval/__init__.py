"""Evaluation: parity against the reference implementation, perplexity, and the benchmarks' quality checks."""
