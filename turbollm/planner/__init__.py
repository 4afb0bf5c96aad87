"""The analytical planner (`turbollm plan`): memory, the concurrency that fits, and step times for an engine
configuration and a workload, from the model's shapes and a short profile of the real engine. An offline
tool: the serving path never imports it."""
