"""The scheduler side: sequences, the scheduler, the block pool and the KV-cache manager, the KV policies and
eviction. It reads the hand-off contract (`turbollm.handoff`) and never imports the worker side or the executors."""
