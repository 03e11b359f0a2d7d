#!/usr/bin/env bash
# The GPU check (issue 48): what a lent GPU's few minutes must measure, in one command meant to
# take at most 8 minutes on an H100 or H200 with cold compile caches (not yet run on a GPU; the
# time limits below bound it), each table a markdown file in OUT_DIR:
#   kernel.md     the Triton kernel's error against float64 in bfloat16, float16 and float32, and
#                 torch.compile through it without a graph break (benchmarks/triton_gpu_check.py)
#   attention.md  attention alone, forward, backward and both, every backend side by side: head
#                 sizes 64 and 128, T = 1,024 and 16,384 (benchmarks/bench_attention.py), with
#                 the Triton kernel's variants alone and together: their ablation (issue 61)
#   nanogpt.md    nanoGPT's own bench.py, unchanged, from ../shared/anchors/nanoGPT (or $NANOGPT)
#   step.md       GPT-2 124M's compiled training step: sdpa (padded vocabulary), unclipped, triton,
#                 triton with every variant of issue 61 (benchmarks/bench_gpu.py)
#   isolation.md  the page's views beside batched decoding on the device, float32 and bfloat16,
#                 each answer the view's alone (tests/inference/test_isolation.py, issue 56;
#                 --smoke: float32 alone, as the suite runs both on a CPU)
# Each step's output goes to its file as it runs (a step cut short keeps its rows so far); a step
# that fails or runs past its time limit (570 s in all, within a device call's 600) is reported,
# and the next one runs. Exits 1 if any failed.
#
# Usage, from anywhere: scripts/gpu_check.sh [--smoke] OUT_DIR (on a lent GPU: scripts/gpu_stage.sh
# here first, and its device command)
#   --smoke: the same steps on a CPU, in a minute or two: the kernel under Triton's interpreter,
#   tiny shapes, nanoGPT's bench.py with its CPU options and its model shrunk to one layer of 64
#   through its GPTConfig (bench.py builds GPT-2 124M: 4.5 s a step on 2 cores). CI runs it
#   (tests/test_gpu_check.py).
set -euo pipefail

SMOKE=0
if [[ "${1:-}" == "--smoke" ]]; then SMOKE=1; shift; fi
[[ $# -eq 1 ]] || { echo "usage: scripts/gpu_check.sh [--smoke] OUT_DIR" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
PYTHON=${PYTHON:-python}
NANOGPT=${NANOGPT:-$ROOT/../shared/anchors/nanoGPT}
STEP_CELLS=("padded vocab 50304" "padded vocab, no clipping" "triton attention"
            "triton, every variant")
if ((SMOKE)); then
  export TRITON_INTERPRET=1
  KERNEL=(--device cpu --head-sizes 16 --lengths 40)
  ATTENTION=(--device cpu --impls sdpa triton
             triton+log2+fused_d+heavy_first+one_launch+half_diagonal+descriptors
             --head-sizes 16 --lengths 32 --seconds 0.01)
  NANO_BATCH=1 NANO_BLOCK=32 NANO=(--device=cpu --compile=False --dtype=float32)
  STEP=(--device cpu --preset nano --dtype float32 --batch-size 1 --block-size 32 --no-compile
        --warmup 0 --steps 1)  # one step: the smoke run shows each cell runs
  export ISOLATION_DEVICE=cpu ISOLATION_K=float32  # the suite runs both dtypes on a CPU already
else
  unset TRITON_INTERPRET  # the kernel compiled for the GPU
  KERNEL=()
  ATTENTION=(--device cuda --head-sizes 64 128 --lengths 1024 16384 --seconds 0.25)
  NANO_BATCH=16 NANO_BLOCK=1024 NANO=(--compile=True)
  STEP=(--warmup 3 --steps 10)
  export ISOLATION_DEVICE=cuda ISOLATION_K=""
fi
NANO+=(--real_data=False --batch_size=$NANO_BATCH --block_size=$NANO_BLOCK)

failed=()
step() {  # step NAME COMMAND...: COMMAND's output to OUT/NAME.md, its errors to OUT/NAME.log
  local name=$1 start=$SECONDS
  shift
  echo "gpu_check: $name ..."
  if "$@" > "$OUT/$name.md" 2> "$OUT/$name.log"; then
    echo "gpu_check: $name done in $((SECONDS - start)) s: $OUT/$name.md"
  else
    echo "gpu_check: $name FAILED (exit $?, $((SECONDS - start)) s); $OUT/$name.log ends:"
    tail -n 5 "$OUT/$name.log" | sed 's/^/    /'
    failed+=("$name")
  fi
}

nanogpt() (  # nanoGPT's bench.py in its own directory, its result as a table
  cd "$NANOGPT" || exit
  export PYTHONDONTWRITEBYTECODE=1  # the anchor is read-only
  if ((SMOKE)); then
    timeout 90 "$PYTHON" - bench.py "${NANO[@]}" <<'EOF'
import runpy, sys, torch
import model  # nanoGPT's model.py
torch.cuda.synchronize = lambda *a, **k: None  # bench.py calls it unconditionally
GPTConfig = model.GPTConfig
model.GPTConfig = lambda **kw: GPTConfig(**{**kw, "n_layer": 1, "n_head": 2, "n_embd": 64})
sys.argv = sys.argv[1:]
runpy.run_path("bench.py", run_name="__main__")
EOF
  else
    timeout 90 "$PYTHON" bench.py "${NANO[@]}"
  fi | tee /dev/stderr | grep '^time per iteration' | awk -v tokens=$((NANO_BATCH * NANO_BLOCK)) \
    -v args="${NANO[*]}" '{ ms = $4 + 0
      printf "nanoGPT bench.py %s, %s\n\n", args, $0
      print "| benchmark | ms a step | tokens/s |\n|---|---:|---:|"
      printf "| nanoGPT bench.py | %.2f | %.0f |\n", ms, tokens * 1000 / ms }'
)

cd "$ROOT"
echo "gpu_check: tables to $OUT$( ((SMOKE)) && echo ' (smoke: CPU, tiny shapes)')"
step kernel timeout 100 "$PYTHON" benchmarks/triton_gpu_check.py "${KERNEL[@]}"
step attention timeout 140 "$PYTHON" benchmarks/bench_attention.py "${ATTENTION[@]}"
step nanogpt nanogpt
step step timeout 180 "$PYTHON" benchmarks/bench_gpu.py "${STEP[@]}" --cells "${STEP_CELLS[@]}"
isolation() {  # pytest's verdict, as a table (its own output to the log)
  local verdict=0
  timeout 60 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" --confcutdir=tests/inference \
    tests/inference/test_isolation.py -k "$ISOLATION_K" >&2 || verdict=$?
  echo "| test | device | verdict |"
  echo "|---|---|---|"
  echo "| page views beside batched decoding, ${ISOLATION_K:-float32 and bfloat16} | $ISOLATION_DEVICE |" \
    "$( ((verdict)) && echo "FAILED ($verdict)" || echo passed) |"
  return $verdict
}
step isolation isolation
if ((${#failed[@]})); then
  echo "gpu_check: FAILED: ${failed[*]}; the tables are in $OUT"
  exit 1
fi
echo "gpu_check: all passed; the tables are in $OUT"
