#!/usr/bin/env bash
# The prepared GPU check (docs: benchmarks/gpu/README.md).  On a lent GPU machine, from the repository root:
#   bash benchmarks/gpu/validate.sh            # GPU path: Llama-3.1-8B architecture, random weights, vLLM CUDA
#   bash benchmarks/gpu/validate.sh --cpu      # CPU path: the tiny model on vLLM CPU and its CPU calibration
# Figures: $OUT/gpu_check.json (OUT defaults to ./gpu-check-out); extra arguments go to gpu_check.py.
# Installs vLLM into .venv when it is missing (the device machine starts bare; needs the package index).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu-check-out}"
DEVICE=gpu
if [[ "${1:-}" == "--cpu" ]]; then DEVICE=cpu; shift; fi
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
# A machine without network (the lent device machines) needs wheels: WHEELS=dir with kvscope's dependencies
# and a vLLM CUDA build matching its torch (pip install --no-index --find-links "$WHEELS").
pipi() {
  if [[ -n "${WHEELS:-}" ]]; then "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$@"
  else "$PY" -m pip install -q "$@"; fi
}
if ! "$PY" -c "import kvscope" 2>/dev/null && ! pipi -e . >/dev/null 2>&1; then
  echo "error: kvscope is not importable and 'pip install -e .' failed (no network? set WHEELS=dir)" >&2; exit 2
fi
if ! "$PY" -c "import vllm" 2>/dev/null && ! pipi vllm >/dev/null 2>&1; then
  echo "error: vLLM is not installed and 'pip install vllm' failed (no network? set WHEELS=dir with a vLLM wheel)" >&2
  exit 2
fi
mkdir -p "$OUT"
start=$(date +%s)
# 8 minutes in all on one H100/H200: the server start (dummy weights, CUDA graphs) takes 1-2, the four levels the rest.
timeout 470 "$PY" benchmarks/gpu/gpu_check.py --out "$OUT" --device "$DEVICE" "$@" 2>&1 | tee "$OUT/gpu_check.log"
echo "gpu check: $(( $(date +%s) - start )) s, figures in $OUT/gpu_check.json"
