#!/usr/bin/env bash
# The learning recipe scaled to a laptop CPU (examples/learn/README.md): a ~0.5M-parameter model, 2-digit problems,
# fewer steps, trainers in one process. The addition half takes about a minute on 2 cores; the ReTool half a few
# minutes (every tool call is a sandboxed interpreter). No GPU, no downloads.
# Run from anywhere: bash examples/learn/cpu.sh [driver options]
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python}
RUN_DIR=${RUN_DIR:-outputs/learn_cpu}
# Small models run fastest with the process's own two threads.
export RLTRAIN_TORCH_THREADS=${RLTRAIN_TORCH_THREADS:-2}

$PYTHON tools/learn_gpu.py data sft grpo --scale cpu --in-process --out "$RUN_DIR" "$@"
$PYTHON tools/learn_gpu.py retool_sft retool_grpo --scale cpu --in-process --out "$RUN_DIR" "$@"
