"""benchmarks/gpu_check.sh's steps that run without a GPU, at tiny shapes, so the script cannot rot
before a GPU runs it: --dry-run runs memory, aot_vs_real (the AOT report against itself), tma and
the kernel benchmark in Triton's interpreter, and the summary; the JSON must hold every section
and every summary key. The GPU-only step (the compiled tests) is left out there."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
SUMMARY_KEYS = {"qwen3_30b_a3b_fwd_tflops", "qwen3_30b_a3b_fwd_bwd_tflops", "mixtral_fwd_tflops",
                "vs_torch_grouped_mm_min", "layer_vs_dense_ffn"}


# The dry run (about 35 s on 2 cores) runs with FMOE_TEST_GPU_CHECK_DRY=1: `make test-gpu-check-dry`, in CI.
@pytest.mark.skipif(os.environ.get("FMOE_TEST_GPU_CHECK_DRY") != "1",
                    reason="gpu_check.sh's dry run: FMOE_TEST_GPU_CHECK_DRY=1 (make test-gpu-check-dry)")
def test_dry_run_writes_every_section_and_the_summary(tmp_path):
    out = tmp_path / "kernels-cpu.json"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["checks"]) == {"memory", "aot_vs_real", "tma", "versus_hf", "fp8"}, doc["checks"]
    assert not [k for k, v in doc["checks"].items() if "error" in v], doc["checks"]
    modes = doc["checks"]["memory"]["modes"]
    assert set(modes) == {"activation", "experts", "none"}
    assert modes["none"]["saved_bytes_per_token"] > modes["activation"]["saved_bytes_per_token"] > 0
    assert all(r["same_registers"] for r in doc["checks"]["aot_vs_real"]["rows"])
    assert doc["grouped_mm"] and doc["layer"]
    versus = doc["checks"]["versus_hf"]["shapes"][0]
    assert set(versus["layers"]) == {"fmoe_activation", "fmoe_experts", "fmoe_none", "hf_grouped_mm", "hf_fmoe_experts"}
    assert all("tflops" in row and "peak_bytes" in row and "first_call_s" in row for row in versus["layers"].values())
    assert 0 < versus["profile_fmoe_default"]["gemm_share"] <= 1
    summary = doc["summary"]
    assert SUMMARY_KEYS | {f"{k}_tma" for k in SUMMARY_KEYS} <= set(summary)
    assert summary["quick"] is True and summary["missing"] == [] and summary["steps_failed"] == []
    assert summary["tiny_default_vs_hf_grouped_mm"]["speed"] > 0 and "tiny_none_not_faster" in summary
    # the layer agreed with the torch backend and the GEMMs with a per-expert matmul, Hopper kernel too
    for row in doc["layer"] + doc["grouped_mm"] + doc["checks"]["tma"]["grouped_mm"]:
        assert row["max_rel_err"] < 2e-2 and row["tma_max_rel_err"] < 2e-2, row["shape"]
    assert doc["triton_autotune"] is False     # gpu_check.sh pins each kernel's config
    fp8 = doc["checks"]["fp8"]["rows"]
    assert set(fp8) == {"bf16", "blockwise", "rowwise", "mxfp8"}
    assert all(row["ms"] > 0 and row["tflops"] > 0 for row in fp8.values())
    assert fp8["bf16"]["relative_error_vs_bf16"] == 0 and 0 < fp8["blockwise"]["relative_error_vs_bf16"] < 0.1


def test_a_failed_step_is_recorded_and_the_rest_still_summed(tmp_path):
    import gpu_check

    out = tmp_path / "k.json"
    log = tmp_path / "memory.log"
    log.write_text("Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory\n")
    gpu_check.main(["init", "--out", str(out)])
    gpu_check.main(["failed", "--out", str(out), "--step", "memory", "--rc", "124", "--log", str(log)])
    junit = tmp_path / "t.xml"
    junit.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1" time="2.5">'
                     '<testcase classname="tests.t" name="a"/><testcase classname="tests.t" name="b">'
                     '<failure message="wrong"/></testcase></testsuite></testsuites>')
    gpu_check.main(["tests", "--out", str(out), "--junit", str(junit), "--rc", "1"])
    assert gpu_check.main(["summary", "--out", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert doc["checks"]["memory"]["error"] == "timed out" and "out of memory" in doc["checks"]["memory"]["log_tail"]
    tests = doc["checks"]["tests"]
    assert (tests["tests"], tests["failures"], tests["skipped"]) == (3, 1, 1) and tests["failed"] == ["tests.t.b: wrong"]
    assert doc["summary"]["steps_failed"] == ["memory", "tests"]
    assert SUMMARY_KEYS <= set(doc["summary"]["missing"])


def test_summary_takes_the_tma_steps_gemm_when_the_benchmark_did_not_get_there():
    import bench_kernels

    def gemm(shape, triton, torch_grouped_mm):
        return {"shape": shape, "results": {"triton": {"tflops": triton}, "triton_tma": {"tflops": 2 * triton},
                                            "torch_grouped_mm": {"tflops": torch_grouped_mm}}}

    payload = {"checks": {"tma": {"grouped_mm": [gemm("qwen3_30b_a3b", 300.0, 400.0)]}}}
    summary = bench_kernels.summarize(payload)
    assert summary["vs_torch_grouped_mm_min"] == 0.75 and summary["vs_torch_grouped_mm_min_tma"] == 1.5
    payload["grouped_mm"] = [gemm("qwen3_30b_a3b", 200.0, 400.0), gemm("mixtral_8x7b", 300.0, 300.0)]
    assert bench_kernels.summarize(payload)["vs_torch_grouped_mm_min"] == 0.5    # the benchmark's own row wins


def test_aot_rows_compare_register_for_register():
    import gpu_check

    aot = [{"target": "sm_90", "dtype": "bf16", "kernel": "k", "pinned": True, "compiled": True, "registers": 200,
            "spill_stores": 0, "spill_loads": 0, "shared": 1024}]
    rows = gpu_check.compare_with_aot([{"kernel": "k", "registers": 210, "spills": 0, "shared": 1024},
                                       {"kernel": "other", "registers": 1, "spills": 0, "shared": 0}], aot, "sm_90")
    assert rows[0]["same_registers"] is False and rows[0]["same_shared"] and rows[0]["no_spills_either"]
    assert rows[1]["aot"] is None


def test_the_real_load_walks_every_launch_with_its_pinned_config(monkeypatch):
    """real_resources' plumbing with the GPU faked: each launch of the AOT report for sm_90 is warmed up
    once with the config FMOE_TRITON_AUTOTUNE=0 pins, and its resources read off the loaded kernel."""
    import gpu_check
    from fmoe.tools import aot

    class Loaded:
        n_regs, n_spills, metadata = 128, 0, SimpleNamespace(shared=4096)

        def _init_handles(self):
            pass

    warmed = []

    def warmup(self, *args, grid, **kwargs):
        warmed.append(kwargs)
        return Loaded()

    names = [name for name, *_ in aot.launches(torch.bfloat16, target=90)]
    for kernel_type in {type(kernel) for _, kernel, *_ in aot.launches(torch.bfloat16, target=90)}:
        monkeypatch.setattr(kernel_type, "warmup", warmup, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    rows = gpu_check.real_resources(time.perf_counter() + 600, device="meta")
    assert [r["kernel"] for r in rows] == names and any(n.startswith("tma_") for n in names)
    tiles = {(w.get("BLOCK_M"), w.get("BLOCK_N"), w.get("num_warps")) for w in warmed if "BLOCK_M" in w}
    # The pinned Hopper tile of the GEMMs; the lean MLP's epilogue kernels pin 64 columns (triton_lean).
    assert tiles == {(128, 256, 8), (128, 128, 8), (128, 64, 8)}
    assert gpu_check.real_resources(time.perf_counter() - 1, device="meta") == []   # past the deadline
