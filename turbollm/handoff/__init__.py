"""The hand-off contract both sides import: the scheduler's and the runner's outputs (plain data that crosses the
process boundary) and the KV-cache specs and configs. It imports neither side."""
