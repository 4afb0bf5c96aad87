"""User-facing front ends: the offline `LLM` API and the CLI."""
