"""Speculative decoding (issue 30): a proposer guesses the next tokens of a sequence, the target
model verifies them in one step. This package holds the configuration (`config.py`, vLLM's
`speculative_config` names) and the proposers behind one interface (`proposers.py`: the interface,
the registry, prompt lookup; `suffix.py`: suffix trees). The scheduler drafts (`Scheduler._drafts`)
and the runner verifies (`ModelRunner._verify`)."""

from turbollm.spec_decode import draft_model, proposers, suffix  # noqa: F401 - the registry's entries
