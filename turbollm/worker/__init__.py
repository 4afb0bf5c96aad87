"""The worker side: the worker, its model runner, the fused decode step, a pipeline stage, the KV rings of recent
tokens, the sampler, the draft model's runner. It never imports the scheduler side."""
