"""`turbollm bench ablation`: what each technique buys (study.py: the configurations and the runs; run_one.py:
one configuration in its own process; report.py: Markdown, the waterfall chart, the rerun check). An offline
tool above the planner (its replay) and the evaluation (perplexity)."""
