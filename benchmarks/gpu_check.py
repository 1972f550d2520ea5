"""The Python steps of benchmarks/gpu_check.sh, one per call, each adding its section to one JSON.

    python benchmarks/gpu_check.py path                       # the JSON's path for this GPU
    python benchmarks/gpu_check.py init --out PATH            # a fresh file: machine, versions
    python benchmarks/gpu_check.py tests --out PATH --junit X --rc N   # pytest's junit report, summed up
    python benchmarks/gpu_check.py memory --out PATH [--quick]         # activation memory per recompute mode
    python benchmarks/gpu_check.py aot_vs_real --out PATH [--quick]    # registers / spills loaded vs the AOT report
    python benchmarks/gpu_check.py tma --out PATH [--quick]            # FMOE_TRITON_TMA=1 against the default
    python benchmarks/gpu_check.py versus_hf --out PATH [--quick]      # the layer beside transformers' block
    python benchmarks/gpu_check.py fp8 --out PATH [--quick]            # FP8 recipes against bf16, Qwen3-30B-A3B
    python benchmarks/gpu_check.py failed --out PATH --step S --rc N --log FILE   # a step that did not finish
    python benchmarks/gpu_check.py summary --out PATH                  # the headline figures (exit 1: a step failed)

Sections land under "checks" (the kernel benchmark, benchmarks/bench_kernels.py --merge, adds its
own sections and "summary" beside them). A step that fails records {"error": ...} in its section and
exits 0, so one failure never hides the others. --quick runs tiny shapes: without a GPU it runs the
steps that can run on a CPU (tests/test_gpu_check.py keeps them from rotting); figures from it
measure nothing.
"""
import argparse
import json
import os
import platform
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # must precede importing the kernels

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import bench_kernels  # noqa: E402
import bench_memory  # noqa: E402
import bench_versus_hf  # noqa: E402
from common import machine  # noqa: E402
from fmoe.app.files import write_json  # noqa: E402

AOT_REPORT = HERE / "results" / "kernels-aot.json"
# Activation memory at Qwen3-30B-A3B's expert shape (full width, 8192 tokens), bf16.
MEMORY_SHAPE = ("qwen3-30b-a3b", 2048, 768, 128, 8)
MEMORY_TOKENS = 8192
QUICK_MEMORY_SHAPE = ("tiny", 16, 16, 4, 2)


def load(out: Path) -> dict:
    return json.loads(out.read_text()) if out.exists() else {}


def record(out: Path, section: str, value: dict):
    doc = load(out)
    doc.setdefault("checks", {})[section] = value
    write_json(out, doc, indent=2)


def versions() -> dict:
    import triton
    info = {**machine(), "platform": platform.platform(), "triton": triton.__version__,
            "cuda": torch.version.cuda, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(capability="sm_{}{}".format(props.major, props.minor), multiprocessors=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2 ** 30, 1))
    return info


def junit_summary(path: Path, rc: int) -> dict:
    """Counts and failed tests of a pytest --junitxml report; rc 124 means `timeout` stopped it."""
    report = {"exit_code": rc, "timed_out": rc == 124}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as err:
        return {**report, "error": f"no junit report: {err}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    for key in ("tests", "failures", "errors", "skipped"):
        report[key] = sum(int(s.get(key, 0)) for s in suites)
    report["seconds"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    report["failed"] = [f"{case.get('classname')}.{case.get('name')}: {(bad.get('message') or '')[:300]}"
                        for s in suites for case in s.iter("testcase") for bad in case
                        if bad.tag in ("failure", "error")]
    if rc != 0:
        report["error"] = "timed out" if rc == 124 else f"pytest exit code {rc}"
    return report


def memory(quick: bool) -> dict:
    """Saved bytes per token (saved_tensors_hooks, exact) and the peak of a forward+backward
    (torch.cuda.max_memory_allocated on a GPU) for each recompute mode, beside a dense FFN."""
    name, d, n, E, K = QUICK_MEMORY_SHAPE if quick else MEMORY_SHAPE
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    row = bench_memory.measure(name, d, n, E, K, 16 if quick else MEMORY_TOKENS, reps=1 if quick else 3,
                               skip=("deepspeed_moe",), device=device, dtype=dtype)
    return {"device": device, "dtype": str(dtype).replace("torch.", ""),
            "peak_from": "torch.cuda.max_memory_allocated" if device == "cuda" else "profiler", **row}


def real_resources(deadline: float, dtype=torch.bfloat16, shape=None, device: str = "cuda") -> list:
    """For each launch of the AOT report (bf16, its pinned config), the kernel compiled by the Triton here
    and loaded on this GPU: registers, spill bytes and shared memory as the driver reports them. Stops
    at time.perf_counter() `deadline`, the rows so far returned."""
    from fmoe.kernels import triton_grouped_mm as gmm, triton_grouped_mm_tma as tma
    from fmoe.tools import aot

    major, minor = torch.cuda.get_device_capability()
    generation = gmm.generation_of(major)
    rows = []
    for name, kernel, args, constexprs, family in aot.launches(dtype, shape or aot.SHAPE, target=10 * major + minor,
                                                               device=device):
        configs = aot.configs_of(family, generation, gmm.dot_mode(dtype), autotune=False)
        if time.perf_counter() > deadline:
            break
        config = configs[0]
        options = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages} if config else {}
        if family == "tma":
            tma.ensure_allocator()
        compiled = kernel.warmup(*args, grid=(1,), **constexprs, **options)
        compiled._init_handles()
        rows.append({"kernel": name, "registers": compiled.n_regs, "spills": compiled.n_spills,
                     "shared": compiled.metadata.shared})
    return rows


def compare_with_aot(real: list, aot_rows: list, target: str, dtype: str = "bf16") -> list:
    """Each real row beside the AOT report's row for the same kernel (pinned config, target, dtype)."""
    pinned = {r["kernel"]: r for r in aot_rows if r["target"] == target and r["dtype"] == dtype
              and r.get("pinned", True) and r.get("compiled")}
    out = []
    for r in real:
        a = pinned.get(r["kernel"])
        if a is None:
            out.append({**r, "aot": None})
            continue
        aot_spills = a["spill_stores"] + a["spill_loads"]
        out.append({**r, "aot": {"registers": a["registers"], "spills": aot_spills, "shared": a["shared"]},
                    "same_registers": r["registers"] == a["registers"], "same_shared": r["shared"] == a["shared"],
                    "no_spills_either": r["spills"] == 0 and aot_spills == 0})
    return out


def aot_vs_real(quick: bool, seconds: float = 30) -> dict:
    aot_doc = json.loads(AOT_REPORT.read_text())
    result = {"aot_report": str(AOT_REPORT.relative_to(HERE.parent)), "aot_triton": aot_doc["triton"]}
    if not torch.cuda.is_available():
        # Without a GPU nothing loads: the comparison runs on the report against itself.
        real = [{"kernel": r["kernel"], "registers": r["registers"], "spills": r["spill_stores"] + r["spill_loads"],
                 "shared": r["shared"]} for r in aot_doc["rows"]
                if r["target"] == "sm_90" and r["dtype"] == "bf16" and r.get("pinned") and r["compiled"]]
        return {**result, "dry_run": "no GPU: the AOT rows compared with themselves",
                "rows": compare_with_aot(real, aot_doc["rows"], "sm_90")}
    import triton
    major, minor = torch.cuda.get_device_capability()
    from fmoe.tools import aot
    launches = len(aot.launches(torch.bfloat16, target=10 * major + minor))
    rows = compare_with_aot(real_resources(time.perf_counter() + seconds), aot_doc["rows"], f"sm_{major}{minor}")
    matched = [r for r in rows if r["aot"]]
    return {**result, "triton": triton.__version__, "rows": rows, "incomplete": len(rows) < launches,
            "registers_match": sum(r["same_registers"] for r in matched), "compared": len(matched),
            "spills_anywhere": [r["kernel"] for r in rows if r["spills"]]}


def tma_check(quick: bool) -> dict:
    """FMOE_TRITON_TMA=1 against the default kernel at Qwen3-30B-A3B's first expert GEMM: the error
    of each against a per-expert matmul, and their times forward and forward+backward beside
    torch._grouped_mm and dense cuBLAS (the benchmark, later, compares them at every shape)."""
    from fmoe.kernels import triton_grouped_mm_tma as tma
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not tma.gpu_takes_tma(torch.cuda.get_device_capability(), torch.bfloat16):
        return {"skipped": "the TMA kernel needs sm_90 or later"}
    shape = (bench_kernels.QUICK_GEMM if quick else bench_kernels.GEMM_SHAPES)[0]
    bench = bench_kernels.timer(quick)
    return {"grouped_mm": bench_kernels.bench_grouped_mm([shape], torch.bfloat16, device, bench)}


def versus_hf(quick: bool) -> dict:
    """fmoe's layer per recompute mode beside transformers' Qwen3-MoE block (grouped_mm experts, and fmoe
    experts with the same weights): TFLOP/s, peak, first-call seconds, a profile (bench_versus_hf.py)."""
    return bench_versus_hf.run(quick, seconds=55)     # the step's budget is 100 s: no shape starts after 55


def versus_hf_summary(doc: dict) -> dict:
    """The issue's headline figures from checks.versus_hf: the default layer at each shape against the
    grouped_mm block, and whether "none" is no faster than the default."""
    out = {}
    for shape in doc.get("checks", {}).get("versus_hf", {}).get("shapes", []):
        rows = shape["layers"]
        default, none = rows.get("fmoe_activation", {}), rows.get("fmoe_none", {})
        name = shape["shape"]
        out[f"{name}_default_fwd_bwd_tflops"] = default.get("tflops")
        out[f"{name}_default_vs_hf_grouped_mm"] = default.get("vs_hf_grouped_mm")
        out[f"{name}_default_first_call_s"] = default.get("first_call_s")
        if "tflops" in default and "tflops" in none:
            out[f"{name}_none_not_faster"] = none["tflops"] <= default["tflops"]
    return out


# FP8 against bf16 at Qwen3-30B-A3B's layer (d_model, d_hidden, experts, top-k; SwiGLU), 4096 tokens.
FP8_SHAPE = ("qwen3-30b-a3b", 2048, 768, 128, 8)
FP8_TOKENS = 4096
QUICK_FP8_SHAPE = ("tiny", 32, 32, 4, 2)


def fp8(quick: bool) -> dict:
    """The layer forward + backward in bf16 and with each FP8 recipe at Qwen3-30B-A3B's shape: ms, TFLOP/s
    of the expert GEMMs (6 x tokens x top-k x d_model x 3 d_hidden: forward, dgrad, wgrad), peak memory, and
    the relative error of the output against bf16. The FP8 GEMMs are fmoe's torch emulation until its FP8
    kernels land (`fmoe.kernels.fp8`): the figures say what the emulation costs, not what FP8 cores give."""
    import fmoe
    from fmoe.kernels.fp8 import RECIPES
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    name, D, F, E, K = QUICK_FP8_SHAPE if quick else FP8_SHAPE
    T = 64 if quick else FP8_TOKENS

    def bench(fn, reps=3):          # the emulation loops over the experts: a few calls, not do_bench's hundreds
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3 / reps
    flops = 6 * T * K * D * 3 * F
    rows, ref = {}, None
    for recipe in (None, *RECIPES):
        torch.manual_seed(0)
        layer = fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=F, top_k=K, activation="swiglu",
                                        gate="naive", fp8=recipe).to(device, dtype)
        x = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)

        def step():
            layer(x).float().sum().backward()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = bench(step)
        with torch.no_grad():
            y = layer(x).float()
        ref = y if ref is None else ref
        rows[recipe or "bf16"] = {
            "ms": round(ms, 3), "tflops": float(f"{flops / (ms * 1e-3) / 1e12:.4g}"),
            "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if device == "cuda" else None,
            "relative_error_vs_bf16": round(((y - ref).norm() / ref.norm()).item(), 5)}
        del layer, x
    base = rows["bf16"]["ms"]
    for row in rows.values():
        row["speed_vs_bf16"] = round(base / row["ms"], 3)
    return {"shape": {"name": name, "d_model": D, "d_hidden": F, "experts": E, "top_k": K, "tokens": T},
            "fp8_gemms": "torch emulation (dequantised, fp32 products)", "rows": rows}


STEPS = {"memory": memory, "aot_vs_real": aot_vs_real, "tma": tma_check, "versus_hf": versus_hf, "fp8": fp8}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=["path", "init", "tests", "failed", "summary", *STEPS])
    p.add_argument("--out", type=Path)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--junit", type=Path)
    p.add_argument("--rc", type=int, default=0)
    p.add_argument("--step", dest="failed_step")
    p.add_argument("--log", type=Path)
    p.add_argument("--seconds", type=float, default=30, help="aot_vs_real: stop loading kernels after this long")
    args = p.parse_args(argv)
    if args.step == "path":
        print(bench_kernels.default_out("cuda" if torch.cuda.is_available() else "cpu"))
        return 0
    if args.out is None:
        p.error("--out is needed")
    if args.step == "init":
        write_json(args.out, {"machine": versions(), "checks": {}}, indent=2)
    elif args.step == "tests":
        record(args.out, "tests", junit_summary(args.junit, args.rc))
    elif args.step == "failed":
        tail = args.log.read_text(errors="replace")[-2000:] if args.log and args.log.exists() else ""
        why = "timed out" if args.rc in (124, 137) else f"exit code {args.rc}"
        doc = load(args.out)
        if "error" not in doc.get("checks", {}).get(args.failed_step, {}):
            record(args.out, args.failed_step, {"error": why, "log_tail": tail,
                                                **doc.get("checks", {}).get(args.failed_step, {})})
    elif args.step == "summary":
        doc = load(args.out)
        doc["summary"] = {**bench_kernels.summarize(doc), **versus_hf_summary(doc)}
        doc["summary"]["steps_failed"] = sorted(k for k, v in doc.get("checks", {}).items()
                                                if "error" in v)
        write_json(args.out, doc, indent=2)
        print(json.dumps(doc["summary"], indent=1))
        return 1 if doc["summary"]["steps_failed"] else 0
    else:
        start = time.perf_counter()
        try:
            extra = {"seconds": args.seconds} if args.step == "aot_vs_real" else {}
            section = STEPS[args.step](args.quick, **extra)
        except Exception as err:    # noqa: BLE001 - a failed step is recorded, the others still run
            section = {"error": f"{type(err).__name__}: {str(err)[:500]}", "traceback": traceback.format_exc()[-3000:]}
        record(args.out, args.step, {**section, "seconds": round(time.perf_counter() - start, 1)})
        print(f"{args.step}: {'error: ' + section['error'] if 'error' in section else 'done'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
