#!/bin/bash
# What a session lent a GPU runs (benchmarks/README.md, "What a session lent a GPU still has
# to run"), as one call of the device tool: each step under its own timeout within a deadline
# (BUDGET seconds, default 540), the most important first, every log and CSV tarred into
# $OUT/res.tar after each step (the tool brings back at most 8 files), a running log in
# $OUT/log.txt. Wheels the device lacks travel in an ignored .whl/ (see the README).
#
#   device run: BUDGET=540 bash benchmarks/gpu_loan.sh        (carry: [".whl"])
#   a dry run here: OUT=/tmp/x BUDGET=30 PY=.venv/bin/python bash benchmarks/gpu_loan.sh
set -u
PY=${PY:-python3}
if ! "$PY" -c "import sqlite_utils, libcst" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
R=/tmp/res
mkdir -p "$R" "$OUT"
LOG=$OUT/log.txt
START=$(date +%s)
DEADLINE=$((START + ${BUDGET:-540}))
pack() { tar -cf "$OUT/res.tar" -C "$R" . 2>/dev/null; }
step() {  # step NAME CAP COMMAND...
  local name=$1 cap=$2 left t0
  shift 2
  left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt 15 ]; then echo "== $name: skipped, $left s left" | tee -a "$LOG"; return; fi
  [ "$cap" -gt "$left" ] && cap=$left
  echo "== $name (cap $cap s) at +$(($(date +%s) - START)) s: $*" | tee -a "$LOG"
  t0=$(date +%s)
  timeout -k 5 "$cap" "$@" 2>&1 | tee "$R/$name.log" | tee -a "$LOG"
  echo "== $name rc ${PIPESTATUS[0]} in $(($(date +%s) - t0)) s" | tee -a "$LOG"
  pack
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__)"
  git log --oneline -1; } 2>&1 | tee -a "$LOG"
step tests_gpu 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py -rfE
step e2e_a8 120 "$PY" benchmarks/optimize_e2e.py --device cuda --workload a --heads 8 \
  --runs 3 --out "$R"
step overhead 90 "$PY" benchmarks/e2e_overhead.py --repeats 2 --profile
step auto 100 "$PY" benchmarks/auto.py --device cuda --workload all --groups 1 --epochs 2
step deterministic 60 "$PY" benchmarks/deterministic.py --rounds 2
step packing 150 "$PY" benchmarks/packing_e2e.py --device cuda --models 64 --batch-models 32
step tests_rest 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests -n 4 \
  --ignore tests/test_gpu.py -rfE
step adapters256 200 "$PY" benchmarks/adapters.py --device cuda --models 256 --steps 3 --out "$R"
cp benchmarks/out/*.csv "$R"/ 2>/dev/null
pack
echo "== done at +$(($(date +%s) - START)) s" | tee -a "$LOG"
