"""Every Triton kernel compiled for A100 (sm_80) and H100/H200 (sm_90) on this machine, no GPU needed; the FP8
kernels also for B200 (sm_100).

`python -m fmoe.tools.aot` compiles each launch as the layer specialises it, every config its
autotuner may pick, bf16, fp16 and fp32 (with and without TF32). It runs in a subprocess: the
test suite makes triton.jit interpret (TRITON_INTERPRET=1), which cannot compile for a GPU. The
results are cached by Triton's compile key, so only a changed kernel or config compiles again
(the first run takes minutes). The Hopper kernel (FMOE_TRITON_TMA=1) is compiled for sm_90 where its
dot has tensor cores, and its SASS is read with the cuobjdump in Triton's wheel.
"""
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GEMMS = {"grouped_mm", "grouped_mm+bias", "gather_grouped_mm", "gather_grouped_mm+bias", "grouped_mm[w^T]",
         "weight_grad", "weight_grad[gather]", "weight_grad[gather_dy]",
         "up_act[gelu]", "up_act[swiglu]", "act_grad[gelu]", "act_grad[swiglu]"}     # the last four: triton_lean
OTHERS = {"expert_row_sums", "permute", "gather_sum", "gather_sum[weighted]", "unpermute_backward",
          "expert_row_sums[weighted]", "slot_sums"}
HOPPER = {"tma_grouped_mm", "tma_grouped_mm+bias", "tma_gather_grouped_mm", "tma_gather_grouped_mm+bias",
          "tma_grouped_mm[w^T]"}
# The FP8 recipes' grouped GEMMs (fmoe.kernels.triton_fp8), forward, input gradient and weight gradient, on sm_90
# and sm_100 (FP8 tensor cores start at sm_89; the other dtypes are checked on sm_80 and sm_90 only).
FP8 = {"fp8_grouped_mm", "fp8_grouped_mm[w^T]", "fp8_weight_grad"}
# The fused FP8 row quantiser (fmoe.kernels.triton_fp8_quantise): no tensor cores, one fixed config.
FP8_QUANTISERS = {"fp8_quantise_rows", "fp8_quantise_rows[swiglu]"}
FP8_DTYPES = ("fp8-blockwise", "fp8-rowwise", "fp8-mxfp8")


def where(row):
    return f"{row['target']} {row['dtype']} {row['kernel']} {row['config']}"


@pytest.fixture(scope="module")
def report_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "kernels-aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-m", "fmoe.tools.aot", "--out", str(out), "--jobs", "2"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert out.exists(), f"no report written (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def doc(report_path):
    return json.loads(report_path.read_text())


@pytest.fixture(scope="module")
def rows(doc):
    return doc["rows"]


def test_every_kernel_and_config_is_compiled_for_each_target_and_dtype(rows):
    kernels = defaultdict(set)
    for r in rows:
        kernels[r["target"], r["dtype"]].add(r["kernel"])
    fp8 = {(t, d) for t in ("sm_90", "sm_100") for d in FP8_DTYPES}
    assert set(kernels) == {(t, d) for t in ("sm_80", "sm_90") for d in ("bf16", "fp16", "fp32-tf32", "fp32-ieee")} | fp8
    hopper = {("sm_90", d) for d in ("bf16", "fp16", "fp32-tf32")}
    for key, names in kernels.items():
        if key in fp8:
            assert names == FP8 | FP8_QUANTISERS, key
            continue
        assert names == GEMMS | OTHERS | (HOPPER if key in hopper else set()), key
    failed = [f"{where(r)}: {r['error']}" for r in rows if not r["compiled"]]
    assert not failed, "\n".join(failed)


def test_shared_memory_within_the_targets_block_limit(rows):
    over = [f"{where(r)}: {r['shared']} > {r['shared_limit']}" for r in rows if r["shared"] > r["shared_limit"]]
    assert not over, "\n".join(over)
    assert {r["shared_limit"] for r in rows if r["target"] == "sm_80"} == {163 * 1024}
    assert {r["shared_limit"] for r in rows if r["target"] in ("sm_90", "sm_100")} == {227 * 1024}


def test_no_register_spills(rows):
    spills = [f"{where(r)}: {r['spill_stores']} bytes stored, {r['spill_loads']} loaded ({r['registers']} registers)"
              for r in rows if r["spill_stores"] or r["spill_loads"]]
    assert not spills, "\n".join(spills)


def test_gemms_use_the_tensor_cores(rows):
    """wgmma on sm_90, tcgen05.mma on sm_100 (FP8) and mma.sync on sm_80; fp32 without TF32 is exact, on the
    CUDA cores (fma)."""
    wanted = {"sm_100": "tcgen05", "sm_90": "wgmma", "sm_80": "mma.sync"}
    for r in rows:
        if r["kernel"] in GEMMS | FP8:
            instruction = "fma" if r["dtype"] == "fp32-ieee" else wanted[r["target"]]
            assert instruction in r["instructions"], f"{where(r)}: {r['instructions']}"
            if r["kernel"] == "fp8_weight_grad" and r["target"] == "sm_90":
                # Its operands run along the tokens, which are not their contiguous dimension: FP8 tensor cores
                # take both operands contiguous along the sum, so Triton stages them through registers.
                continue
            assert "cp.async" in r["instructions"], f"{where(r)}: operands not loaded asynchronously"


def test_fp8_quantisers_convert_to_e4m3_in_hardware(rows):
    """The quantiser's stores come from the GPU's e4m3 conversion, for every recipe, activation fused or not."""
    quantisers = [r for r in rows if r["kernel"] in FP8_QUANTISERS]
    assert len(quantisers) == 2 * len(FP8_DTYPES) * len(FP8_QUANTISERS)
    for r in quantisers:
        assert r["compiled"] and "cvt.e4m3" in r["instructions"], f"{where(r)}: {r['instructions']}"


def test_fp8_on_blackwell_mxfp8_runs_the_block_scaled_mma(rows):
    """sm_100: MXFP8's forward and input gradient on tcgen05's block-scaled MMA; the other recipes (and the weight
    gradient, whose blocks run along the tokens) on tcgen05 with the scales applied in the accumulator."""
    blackwell = [r for r in rows if r["target"] == "sm_100" and r["kernel"] in FP8]
    assert len(blackwell) == len(FP8_DTYPES) * len(FP8)
    for r in blackwell:
        scaled = r["dtype"] == "fp8-mxfp8" and r["kernel"] != "fp8_weight_grad"
        assert ("block_scale" in r["instructions"]) == scaled, f"{where(r)}: {r['instructions']}"


def test_the_pinned_config_is_one_per_gemm_target_and_dtype(rows):
    """FMOE_TRITON_AUTOTUNE=0 launches the first config alone: it is compiled (and passes the
    checks above) for every dtype and target."""
    pinned = defaultdict(list)
    for r in rows:
        if r["kernel"] in GEMMS | HOPPER | FP8 and r["pinned"]:
            pinned[r["target"], r["dtype"], r["kernel"]].append(r)
    assert len(pinned) == 2 * 4 * len(GEMMS) + 3 * len(HOPPER) + 2 * len(FP8_DTYPES) * len(FP8)
    assert all(len(found) == 1 and found[0]["compiled"] for found in pinned.values())


def test_hopper_kernel_moves_tiles_with_the_copy_engine_and_multiplies_with_wgmma(doc, rows):
    """cp.async.bulk.tensor and wgmma in the PTX; in the SASS (the wheel's cuobjdump) the copy engine's
    loads and stores (UTMALDG, UTMASTG) and HGMMA, no spills; gathered rows come by cp.async (LDGSTS)."""
    hopper = [r for r in rows if r["kernel"] in HOPPER]
    assert hopper and {r["target"] for r in hopper} == {"sm_90"}
    for r in hopper:
        assert {"cp.async.bulk.tensor", "wgmma"} <= set(r["instructions"]), where(r)
        assert r["global_scratch"] > 0, f"{where(r)}: descriptors made on the device need global scratch"
        if not doc["cuobjdump"]:
            pytest.skip("this Triton wheel ships no cuobjdump: checked on the PTX only")
        assert {"UTMALDG", "UTMASTG", "HGMMA"} <= set(r["sass"]), f"{where(r)}: {r['sass']}"
        assert not {"LDL", "STL"} & set(r["sass"]), f"{where(r)}: local memory"
        assert ("LDGSTS" in r["sass"]) == ("gather" in r["kernel"]), f"{where(r)}: {r['sass']}"


def test_why_gathered_rows_are_not_loaded_by_descriptor(doc):
    """Triton 3.9 lowers a descriptor gather to TMA's tile::gather4, which ptxas takes on sm_100 only."""
    assert "requires .target sm_100" in doc["descriptor_gather"]["sm_90"]
    assert doc["descriptor_gather"]["sm_100"] == "compiles, tile::gather4"


def test_fmoe_info_prints_the_report(report_path, capsys, tmp_path):
    from fmoe.app import cli

    assert cli.main(["info", "--aot", str(report_path)]) == 0
    out = capsys.readouterr().out
    assert "0 problems" in out and "sm_90 bf16" in out and "limit 227 KB" in out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["info", "--aot", str(tmp_path / "missing.json")])
    assert exit_info.value.code == 2
    assert "python -m fmoe.tools.aot --out" in capsys.readouterr().err
