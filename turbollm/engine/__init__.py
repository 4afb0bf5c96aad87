"""The front door: `LLMEngine` (requests in, outputs out), output processing and detokenizing. The scheduler side
is `turbollm.core`, the hand-off contract `turbollm.handoff`, the executors `turbollm.executor`, the worker side
`turbollm.worker`; the engine arguments are `turbollm.engine_args` (read by every side, so outside this folder)."""
