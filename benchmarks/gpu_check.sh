#!/usr/bin/env bash
# One GPU check, under 8 minutes on one H200, each step time-boxed; a step that fails or times out is
# recorded in the JSON and the next one runs. Writes benchmarks/results/kernels-<gpu name>.json:
#   checks.tests        the Triton kernel tests compiled for this GPU (tests/test_triton_kernels.py,
#                       the Hopper kernel's tests/test_triton_tma.py, the sync-free / CUDA-graph
#                       checks of tests/test_gpu_sync.py): counts and failed tests
#   checks.memory       activation memory per recompute mode (saved bytes, torch.cuda.max_memory_allocated)
#   checks.aot_vs_real  registers / spills / shared memory of each kernel loaded here vs kernels-aot.json
#   checks.tma          the Hopper kernel against the plain one, Qwen3's first GEMM
#   checks.versus_hf    the layer in each recompute mode beside transformers' Qwen3-MoE block with grouped_mm
#                       experts and with fmoe experts (same weights), autotuned: TFLOP/s, peak memory,
#                       first-call seconds, a profile of the default (GEMM share, top other kernels)
#   checks.fp8          the layer in bf16 and with each FP8 recipe at Qwen3-30B-A3B's shape: ms, TFLOP/s, peak
#                       memory, error against bf16 (the FP8 GEMMs are the torch emulation for now)
#   grouped_mm, fused_gather, layer   the kernel benchmark (benchmarks/bench_kernels.py): TFLOP/s at the
#                       Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V3 expert shapes beside torch._grouped_mm
#                       and a dense cuBLAS FFN of the same FLOPs
#   summary             qwen3_30b_a3b_fwd_tflops, qwen3_30b_a3b_fwd_bwd_tflops, mixtral_fwd_tflops,
#                       vs_torch_grouped_mm_min, layer_vs_dense_ffn (and *_tma), per versus_hf shape the
#                       default's TFLOP/s, its ratios to the grouped_mm block, first call, none_not_faster;
#                       steps_failed
# plus the logs beside it. Needs only the repository (not installed) and torch + triton + pytest.
# The kernels run their pinned config (FMOE_TRITON_AUTOTUNE=0): autotuning every shape of the
# benchmark would spend the budget compiling. GPU_CHECK_AUTOTUNE=1 tunes the benchmark's kernels.
#
#     bash benchmarks/gpu_check.sh             # on a CUDA GPU (GPU_CHECK_OUT=PATH: the JSON elsewhere)
#     bash benchmarks/gpu_check.sh --dry-run OUT.json   # no GPU: the CPU-runnable steps at tiny shapes
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
TOTAL=${GPU_CHECK_SECONDS:-455}    # leaves the last summary inside 8 minutes
start=$SECONDS
quick=()
if [ "${1:-}" = "--dry-run" ]; then
    quick=(--quick)
    out=${2:?--dry-run needs the JSON path}
    export TRITON_INTERPRET=1
else
    unset TRITON_INTERPRET FMOE_BACKEND FMOE_TRITON_TMA
    $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check.sh: no CUDA GPU here')" || exit 2
    out=${GPU_CHECK_OUT:-$($PY benchmarks/gpu_check.py path)}
fi
logs="${out%.json}-logs"
mkdir -p "$logs"
$PY benchmarks/gpu_check.py init --out "$out" || exit 1

# step NAME SECONDS COMMAND...: runs COMMAND for at most SECONDS (less if the total budget is nearer),
# logging to $logs/NAME.log; a failure or timeout is recorded under checks.NAME; its exit code in last_rc.
last_rc=0
step() {
    local name=$1 budget=$2
    shift 2
    local left=$((TOTAL - (SECONDS - start)))
    [ "$budget" -gt "$left" ] && budget=$left
    if [ "$budget" -le 5 ]; then
        echo "gpu_check: no time left for $name"
        $PY benchmarks/gpu_check.py failed --out "$out" --step "$name" --rc 124
        last_rc=124
        return
    fi
    echo "== $name (at most ${budget}s)"
    timeout -k 10 "$budget" "$@" > "$logs/$name.log" 2>&1
    last_rc=$?
    tail -n 25 "$logs/$name.log"
    [ $last_rc = 0 ] || $PY benchmarks/gpu_check.py failed --out "$out" --step "$name" --rc $last_rc --log "$logs/$name.log"
}

if [ ${#quick[@]} = 0 ]; then
    # One config per kernel in the tests: autotuning every tiny shape would spend minutes compiling;
    # the compiles spread over processes where pytest-xdist is installed (the H200 image has it).
    parallel=$($PY -c "import xdist" 2>/dev/null && echo "-n 6")
    FMOE_TRITON_AUTOTUNE=0 step tests 120 $PY -m pytest tests/test_triton_kernels.py tests/test_triton_tma.py \
        tests/test_gpu_sync.py -q -rfE -p no:cacheprovider $parallel --junitxml="$logs/tests.xml"
    $PY benchmarks/gpu_check.py tests --out "$out" --junit "$logs/tests.xml" --rc "$last_rc"
fi
FMOE_TRITON_AUTOTUNE=0 step memory 40 $PY benchmarks/gpu_check.py memory --out "$out" ${quick[@]+"${quick[@]}"}
autotune=${GPU_CHECK_AUTOTUNE:-0}
# Autotuned, as users run it: the first call's seconds are part of what it measures.
FMOE_TRITON_AUTOTUNE=1 step versus_hf 100 $PY benchmarks/gpu_check.py versus_hf --out "$out" ${quick[@]+"${quick[@]}"}
FMOE_TRITON_AUTOTUNE=$autotune step tma 30 $PY benchmarks/gpu_check.py tma --out "$out" ${quick[@]+"${quick[@]}"}
FMOE_TRITON_AUTOTUNE=$autotune step bench 120 $PY benchmarks/bench_kernels.py --merge --out "$out" --sections layer,grouped_mm ${quick[@]+"${quick[@]}"}
step fp8 30 $PY benchmarks/gpu_check.py fp8 --out "$out" ${quick[@]+"${quick[@]}"}
# Last: the benchmark has compiled most of these kernels (pinned configs; the same specialisation).
step aot_vs_real 35 $PY benchmarks/gpu_check.py aot_vs_real --out "$out" --seconds 30 ${quick[@]+"${quick[@]}"}
$PY benchmarks/gpu_check.py summary --out "$out"
summary_rc=$?
echo "gpu_check: $((SECONDS - start)) s; results in $out, logs in $logs/"
exit $summary_rc     # 1 when a step failed (summary.steps_failed)
