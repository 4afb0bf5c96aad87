"""Evaluation: parity against the reference implementation (and, later, perplexity)."""
