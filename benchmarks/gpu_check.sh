#!/usr/bin/env bash
# On a CUDA machine, in under 8 minutes: the Triton kernel tests compiled (no interpreter) and the
# sync-free / CUDA-graph checks (tests/test_gpu_sync.py), then the kernel benchmark. Results land in
# benchmarks/results/: gpu-tests.json (counts and failed tests), kernels-<gpu name>.json (the
# benchmark; written section by section), and both logs.
# Needs only the repository (not installed) and torch + triton + pytest.
#
#     bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
RESULTS=benchmarks/results
mkdir -p "$RESULTS"
unset TRITON_INTERPRET FMOE_BACKEND
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check.sh: no CUDA GPU here')" || exit 2
start=$SECONDS

# One config per kernel in the tests: autotuning every tiny shape would spend minutes compiling.
FMOE_TRITON_AUTOTUNE=0 timeout 270 python -m pytest tests/test_triton_kernels.py tests/test_gpu_sync.py -q -rfE \
    --junitxml="$RESULTS/gpu-tests.xml" 2>&1 | tee "$RESULTS/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
python - "$RESULTS/gpu-tests.xml" "$tests_rc" > "$RESULTS/gpu-tests.json" <<'PY'
import json, platform, sys, torch, triton
import xml.etree.ElementTree as ET
path, rc = sys.argv[1], int(sys.argv[2])
report = {"exit_code": rc, "timed_out": rc == 124, "gpu": torch.cuda.get_device_name(),
          "python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
try:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    report.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
    report["seconds"] = float(suite.get("time", 0))
    report["failed"] = [f"{case.get('name')}: {(bad.get('message') or '')[:300]}"
                        for case in suite.iter("testcase") for bad in case if bad.tag in ("failure", "error")]
except (OSError, ET.ParseError) as err:
    report["junit_error"] = str(err)
print(json.dumps(report, indent=2))
PY

timeout $((470 - (SECONDS - start))) python benchmarks/bench_kernels.py 2>&1 | tee "$RESULTS/bench-kernels.log"
bench_rc=${PIPESTATUS[0]}

echo "gpu_check: tests exit $tests_rc, benchmark exit $bench_rc, $((SECONDS - start)) s; results in $RESULTS/"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
