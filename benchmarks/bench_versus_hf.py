"""fmoe's layer in each recompute mode beside transformers' Qwen3-MoE block, forward+backward (not a test).

In one process, at each expert shape (Qwen3-30B-A3B, OLMoE, Mixtral-8x7B; --quick: a tiny one):

- fmoe's FMoETransformerMLP (SwiGLU, no expert bias), recompute "activation" (the default),
  "experts" and "none";
- transformers' Qwen3MoeSparseMoeBlock with its `grouped_mm` experts, and the same block with the
  same weights switched to fmoe's experts implementation (`config._experts_implementation = "fmoe"`);

each: first-call seconds (autotuning included when FMOE_TRITON_AUTOTUNE is not 0), time of a
forward+backward (median of `triton.testing.do_bench` on a GPU), TFLOP/s (3 x 2 T K 3 d n: the
expert GEMMs; the router's left out), the peak memory of one forward+backward above what was
allocated before it (`torch.cuda.max_memory_allocated`; on a CPU, the profiler's), and ratios to the
`grouped_mm` block. Then a profile of fmoe's default layer: the GEMMs' share of device time and the
slowest other kernels. JSON only where --out says.

    python benchmarks/bench_versus_hf.py --out /tmp/versus-hf.json           # on a GPU
    python benchmarks/bench_versus_hf.py --quick                              # any machine, tiny shapes
"""
import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported

import fmoe  # noqa: E402
from bench_memory import hf_block  # noqa: E402
from fmoe.app.files import write_json  # noqa: E402
from fmoe.observe.memory import peak_bytes  # noqa: E402

# (name, d_model, expert hidden, experts, top-k, tokens)
SHAPES = [("qwen3_30b_a3b", 2048, 768, 128, 8, 16384), ("olmoe", 2048, 1024, 64, 8, 16384),
          ("mixtral_8x7b", 4096, 14336, 8, 2, 8192)]
QUICK = [("tiny", 64, 32, 8, 2, 32)]
MODES = ("activation", "experts", "none")
# Kernels counted as GEMMs in the profile: fmoe's Triton GEMMs and cuBLAS / CUTLASS ones.
GEMM_MARKS = ("grouped_mm", "up_act", "act_grad", "weight_grad", "gemm", "cutlass", "nvjet", "sm90_", "sm80_",
              "aten::mm", "aten::addmm", "aten::bmm")


def layers(d, n, E, K, device, dtype):
    """{name: module}: fmoe's modes, and the HF block with grouped_mm and with fmoe experts (same weights)."""
    from fmoe.integrations.hf.experts_impl import register_experts_implementation
    out = {}
    for mode in MODES:
        torch.manual_seed(0)
        out[f"fmoe_{mode}"] = fmoe.FMoETransformerMLP(num_expert=E, d_model=d, d_hidden=n, top_k=K, activation="swiglu",
                                                      expert_bias=False, recompute=mode).to(device, dtype)
    torch.manual_seed(0)
    out["hf_grouped_mm"] = hf_block(d, n, E, K, "grouped_mm").to(device, dtype)
    if register_experts_implementation():
        block = copy.deepcopy(out["hf_grouped_mm"])     # the experts read their own config at every call
        block.experts.config = copy.deepcopy(block.experts.config)
        block.experts.config._experts_implementation = "fmoe"
        out["hf_fmoe_experts"] = block
    return out


def fwd_bwd(module, x, dy):
    def run():
        for p in module.parameters():
            p.grad = None
        x.grad = None
        y = module(x)
        torch.autograd.backward(y[0] if isinstance(y, tuple) else y, dy)
    return run


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_ms(fn, quick: bool) -> float:
    if torch.cuda.is_available():
        import triton
        return float(triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100,
                                             return_mode="median"))
    fn()
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def peak(fn, device) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    return peak_bytes(fn, torch.device(device))


def profile_summary(fn, top: int = 6) -> dict:
    """The GEMMs' share of device time (CPU time without a GPU) over two calls, and the slowest others."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    fn()
    sync()
    with profile(activities=activities) as prof:
        fn()
        fn()
        sync()
    rows = []
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us > 0 and (cuda or event.key.startswith(("aten::", "triton", "_"))):
            rows.append((event.key, us))
    total = sum(us for _, us in rows) or 1.0
    gemm = sum(us for name, us in rows if any(mark in name for mark in GEMM_MARKS))
    others = sorted(((name, us) for name, us in rows if not any(mark in name for mark in GEMM_MARKS)),
                    key=lambda r: -r[1])[:top]
    return {"gemm_share": round(gemm / total, 3), "device_time_us": round(total / 2, 1),
            "top_non_gemm": [{"kernel": name[:90], "share": round(us / total, 3)} for name, us in others]}


def _sig(value: float) -> float:
    """Four significant digits (a CPU's tiny rates stay nonzero)."""
    return float(f"{value:.4g}")


def bench_shape(name, d, n, E, K, T, device, dtype, quick):
    modules = layers(d, n, E, K, device, dtype)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, T, d, device=device, dtype=dtype, generator=g).requires_grad_(True)
    dy = torch.randn(1, T, d, device=device, dtype=dtype, generator=g)
    flops = 3 * 2.0 * T * K * 3 * d * n
    rows = {}
    for label, module in modules.items():
        run = fwd_bwd(module, x, dy)
        try:
            sync()
            start = time.perf_counter()
            run()
            sync()
            first = time.perf_counter() - start
            ms = timed_ms(run, quick)
            rows[label] = {"first_call_s": round(first, 2), "ms": round(ms, 3),
                           "tflops": _sig(flops / (ms * 1e-3) / 1e12), "peak_bytes": peak(run, device)}
        except Exception as err:    # noqa: BLE001 - one competitor failing is a finding, the others still run
            rows[label] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        print(f"{name:<14}{label:<18}" + ("  ".join(f"{k} {v}" for k, v in rows[label].items())), flush=True)
    base = rows.get("hf_grouped_mm", {})
    for row in rows.values():
        if "tflops" in row and base.get("tflops"):
            row["vs_hf_grouped_mm"] = {"speed": _sig(row["tflops"] / base["tflops"]),
                                       "peak": _sig(row["peak_bytes"] / max(base["peak_bytes"], 1))}
    default = modules["fmoe_activation"]
    return {"shape": name, "d_model": d, "d_hidden": n, "experts": E, "top_k": K, "tokens": T, "layers": rows,
            "profile_fmoe_default": profile_summary(fwd_bwd(default, x, dy))}


def run(quick: bool, seconds: float = float("inf")) -> dict:
    """Every shape (QUICK with `quick`), none started after `seconds` (those listed under "skipped")."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    start, results, skipped = time.perf_counter(), [], []
    for shape in QUICK if quick else SHAPES:
        if time.perf_counter() - start > seconds:
            skipped.append(shape[0])
            continue
        results.append(bench_shape(*shape, device, dtype, quick))
    return {"device": device, "dtype": str(dtype).replace("torch.", ""),
            "autotune": os.environ.get("FMOE_TRITON_AUTOTUNE", "1") != "0", "shapes": results, "skipped": skipped}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny shape (any machine; measures nothing)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    parser.add_argument("--seconds", type=float, default=float("inf"), help="start no shape after this long")
    args = parser.parse_args(argv)
    result = run(args.quick, args.seconds)
    if args.out:
        write_json(args.out, result, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
