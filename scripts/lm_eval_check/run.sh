#!/usr/bin/env bash
# lm-evaluation-harness against `turbollm serve`, on a small local task (make_task.py): its log-likelihood
# requests (echo + logprobs on /v1/completions), its generation requests, and its remote tokenizer
# (/tokenizer_info, /tokenize, /detokenize). lm-eval lives in its own venv (it pins its own dependencies):
#   python3 -m venv ../lmeval-venv && ../lmeval-venv/bin/pip install torch==2.13.0 "lm_eval[api]"
# Usage: scripts/lm_eval_check/run.sh [MODEL] [N_DOCS]   (from the repository root; LM_EVAL_PY overrides the venv)
set -euo pipefail
MODEL=${1:-smollm2-135m}
N=${2:-40}
LM_EVAL_PY=${LM_EVAL_PY:-../lmeval-venv/bin/python}
PORT=${PORT:-8765}
WORK=$(mktemp -d)
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT

.venv/bin/python scripts/lm_eval_check/make_task.py "$WORK/tasks" "$N"
.venv/bin/turbollm serve "$MODEL" --port "$PORT" --log-level warning > "$WORK/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 0.5; done
curl -sf "http://127.0.0.1:$PORT/health" > /dev/null || { cat "$WORK/server.log"; exit 1; }
HF_DATASETS_OFFLINE=1 "$LM_EVAL_PY" -m lm_eval --model local-completions \
    --model_args "base_url=http://127.0.0.1:$PORT/v1/completions,model=$MODEL,num_concurrent=1,max_retries=1,tokenizer_backend=remote" \
    --include_path "$WORK/tasks" --tasks turbollm_lastword_ll,turbollm_lastword_gen --batch_size 8 \
    --output_path "$WORK/out" 2>&1 | grep -v "^WARNING: Location" | tail -25
