"""Speculative decoding (issue 30): a proposer guesses the next tokens of a sequence, the target
model verifies them in one step. This package holds the configuration (`config.py`, vLLM's
`speculative_config` names) and the proposers behind one interface (`proposers.py`: the interface,
the registry, prompt lookup; `suffix.py`: suffix trees; `draft_model.py`: a draft model; `adaptive.py`: drafts
per sequence and step). The worker drafts after each step (worker/drafter.py) and verifies in the next
(worker/rejection.py); the scheduler reserves room for the drafts (core/scheduler_spec.py)."""

from turbollm.spec_decode import draft_model, proposers, suffix  # noqa: F401 - the registry's entries
