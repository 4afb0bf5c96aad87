"""The engine core: requests, scheduler, KV-cache blocks, model runner, sampler."""
