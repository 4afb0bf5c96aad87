"""Speculative decoding (issue 30): a proposer guesses the next tokens of a sequence, the target
model verifies them in one step. This package holds the parts that do not touch the engine core:
the configuration (`config.py`, vLLM's `speculative_config` names) and the proposers behind one
interface (`proposers.py`). The scheduler / runner / sampler wiring comes with issue 30."""
