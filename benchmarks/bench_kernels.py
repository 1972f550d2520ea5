"""The expert kernels beside their competitors, in one process, in bf16 on a GPU.

    python benchmarks/bench_kernels.py            # full shapes, CUDA
    python benchmarks/bench_kernels.py --quick    # tiny shapes; on CPU the kernels run in Triton's interpreter

Shapes: the experts of Qwen3-30B-A3B (E 128, H 2048, I 768, K 8, T 32768), Mixtral-8x7B (E 8,
H 4096, I 14336, K 2, T 8192) and DeepSeek-V3 (E 256, H 7168, I 2048, K 8, T 8192), SwiGLU.
Sections:
  grouped_mm   The first expert GEMM (H -> 2I over T*K rows): Triton grouped GEMM, the same with
               FMOE_TRITON_TMA=1 (the Hopper kernel), torch._grouped_mm, one dense cuBLAS matmul
               over the same rows (the ceiling) and a per-expert loop: forward, then forward+backward
               (Triton, torch path, dense). Qwen3's shape also with Zipf-skewed counts.
  fused_gather The first expert GEMM reading x_TD through token_N (gather_grouped_mm) against
               permute + grouped_mm, both Triton, and the torch path.
  layer        FMoETransformerMLP (balanced routing) forward, and forward+backward: Triton, Triton
               with FMOE_TRITON_TMA=1, the torch backend, and a dense SwiGLU FFN of the same FLOPs.
  summary      The headline figures (`summarize`).
TFLOP/s count the experts' GEMMs only (2 * rows * in * out each; backward twice the forward).
Prints tables with TFLOP/s and ratios, writes benchmarks/results/kernels-<gpu name>.json
(--merge: into what the file holds, as benchmarks/gpu_check.sh does).
"""
import argparse
import contextlib
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # must precede importing the kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fmoe  # noqa: E402
from common import RESULTS, RoundRobinGate, SwiGLU, machine  # noqa: E402
from fmoe import kernels  # noqa: E402
from fmoe.app.files import write_json  # noqa: E402
from fmoe.kernels.triton_grouped_mm import _grouped_mm_kernel, _launcher, interpreting  # noqa: E402
from fmoe.routing import RoutingPlan  # noqa: E402

# (name, tokens T, top-k K, d_model D, expert hidden F, experts E): the models' expert layers.
MODELS = [("qwen3_30b_a3b", 32768, 8, 2048, 768, 128), ("mixtral_8x7b", 8192, 2, 4096, 14336, 8),
          ("deepseek_v3", 8192, 8, 7168, 2048, 256)]
QUICK_MODELS = [("tiny", 16, 2, 16, 16, 4)]


def gemm_shapes(models, skewed=("qwen3_30b_a3b", "tiny")):
    """(name, rows N, in I, out O, experts E, count distribution): each model's first expert GEMM
    (H -> 2I, gate and up together), and the named ones again with Zipf-skewed counts."""
    rows = [(name, T * K, D, 2 * F, E, "uniform") for name, T, K, D, F, E in models]
    return rows + [(f"{name}_skewed", N, I, O, E, "zipf") for name, N, I, O, E, _ in rows if name in skewed]


GEMM_SHAPES, QUICK_GEMM = gemm_shapes(MODELS), gemm_shapes(QUICK_MODELS)
GATHER_SHAPES, QUICK_GATHER = MODELS[:2], QUICK_MODELS
LAYER_SHAPES, QUICK_LAYER = MODELS, QUICK_MODELS


@contextlib.contextmanager
def tma(on: bool):
    """FMOE_TRITON_TMA set to `on` inside (read at every launch), restored after."""
    before = os.environ.get("FMOE_TRITON_TMA")
    os.environ["FMOE_TRITON_TMA"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["FMOE_TRITON_TMA"]
        else:
            os.environ["FMOE_TRITON_TMA"] = before


def with_tma(fn):
    """fn run with the Hopper kernel opted in."""
    def run():
        with tma(True):
            return fn()
    return run


def timer(quick: bool):
    """ms per call of fn(): triton's do_bench (CUDA events, median) on a GPU; elsewhere (--quick on
    CPU, where it only exercises the script) the wall time of one call after a warm-up."""
    if torch.cuda.is_available():
        import triton.testing
        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=10 if quick else 100, return_mode="median")

    def wall(fn):
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return wall


def split_counts(N: int, E: int, dist: str, device) -> torch.Tensor:
    """Rows per expert: N/E each, or Zipf(1.2) shares with the remainder on the first expert."""
    if dist == "uniform":
        counts = [N // E] * E
    else:
        shares = [1 / (e + 1) ** 1.2 for e in range(E)]
        counts = [math.floor(N * s / sum(shares)) for s in shares]
    counts[0] += N - sum(counts)
    return torch.tensor(counts, device=device)


def run_all(fns: dict, bench) -> dict:
    """{name: {"ms": ...}} or {"error": ...} for competitors this machine cannot run."""
    out = {}
    for name, fn in fns.items():
        try:
            out[name] = {"ms": bench(fn)}
        except (RuntimeError, NotImplementedError, ValueError) as err:
            out[name] = {"error": str(err).splitlines()[0][:200]}
    return out


def add_rates(results: dict, flops: float, baseline: str):
    """TFLOP/s of each row, and how many times faster the baseline is than the row."""
    base = results[baseline].get("ms")
    for row in results.values():
        if "ms" in row:
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
            row[baseline + "_speedup"] = row["ms"] / base if base else None


def print_table(title: str, results: dict, baseline: str):
    print(f"\n{title}")
    print(f"  {'':22s}{'ms':>10s}{'TFLOP/s':>10s}{baseline + ' is':>22s}")
    for name, row in results.items():
        if "error" in row:
            print(f"  {name:22s}  unavailable: {row['error']}")
        else:
            print(f"  {name:22s}{row['ms']:10.3f}{row['tflops']:10.1f}{row[baseline + '_speedup']:21.2f}x")


def grads_fn(fn, inputs, grad_out):
    """fn() forward + backward for `inputs`, no gradient accumulation between calls."""
    return lambda: torch.autograd.grad(fn(), inputs, grad_out)


def relative_error(out, ref) -> dict:
    diff = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    scale = ref.float().abs().max().item() if ref.numel() else 0.0
    return {"max_abs_err": diff, "max_rel_err": diff / scale if scale else diff}


def bench_grouped_mm(shapes, dtype, device, bench):
    rows = []
    for name, N, I, O, E, dist in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(N, I, device=device, dtype=dtype, generator=gen)
        w = torch.randn(E, I, O, device=device, dtype=dtype, generator=gen) / I ** 0.5
        counts = split_counts(N, E, dist, device)
        dy = torch.randn(N, O, device=device, dtype=dtype, generator=gen)
        with torch.no_grad():
            y = kernels.grouped_mm(x, w, counts, backend="triton")
            with tma(True):
                y_tma = kernels.grouped_mm(x, w, counts, backend="triton")
            ref = torch.cat([x_e @ w[e] for e, x_e in enumerate(torch.split(x, counts.tolist()))])
        fwd = run_all({
            "triton": lambda: kernels.grouped_mm(x, w, counts, backend="triton"),
            "triton_tma": with_tma(lambda: kernels.grouped_mm(x, w, counts, backend="triton")),
            "torch_grouped_mm": lambda: torch._grouped_mm(x, w, offs=torch.cumsum(counts, 0, dtype=torch.int32)),
            "dense_cublas": lambda: x @ w[0],
            "expert_loop": lambda: [x_e @ w[e] for e, x_e in enumerate(torch.split(x, counts.tolist()))],
        }, bench)
        flops = 2.0 * N * I * O
        add_rates(fwd, flops, "triton")
        print_table(f"grouped_mm forward, {name}: N={N} {I}->{O}, E={E}, {dist} counts", fwd, "triton")
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        fwd_bwd = run_all({
            "triton": grads_fn(lambda: kernels.grouped_mm(xg, wg, counts, backend="triton"), [xg, wg], dy),
            "triton_tma": with_tma(grads_fn(lambda: kernels.grouped_mm(xg, wg, counts, backend="triton"), [xg, wg], dy)),
            "torch_path": grads_fn(lambda: kernels.grouped_mm(xg, wg, counts, backend="torch"), [xg, wg], dy),
            "dense_cublas": grads_fn(lambda: xg @ wg[0], [xg, wg], dy),
        }, bench)
        add_rates(fwd_bwd, 3 * flops, "triton")
        print_table(f"grouped_mm forward+backward, {name}", fwd_bwd, "triton")
        config = _launcher(_grouped_mm_kernel, x.device, x.dtype).best_config
        rows.append({"shape": name, "rows": N, "in": I, "out": O, "experts": E, "counts": dist,
                     "counts_e": counts.tolist(), "triton_config": str(config), **relative_error(y, ref),
                     **{f"tma_{k}": v for k, v in relative_error(y_tma, ref).items()},
                     "results": fwd, "fwd_bwd": fwd_bwd})
    return rows


def random_plan(T, K, E, device):
    gen = torch.Generator(device=device).manual_seed(1)
    idx_TK = torch.rand(T, E, device=device, generator=gen).topk(K, dim=1).indices
    return RoutingPlan.build(idx_TK, E)


def bench_fused_gather(shapes, dtype, device, bench):
    rows = []
    for name, T, K, D, F_, E in shapes:
        plan = random_plan(T, K, E, device)
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(T, D, device=device, dtype=dtype, generator=gen, requires_grad=True)
        w = (torch.randn(E, D, F_, device=device, dtype=dtype, generator=gen) / D ** 0.5).requires_grad_()
        dy = torch.randn(plan.num_rows, F_, device=device, dtype=dtype, generator=gen)
        args = (plan.token_N, w, plan.counts_E, plan.row_of_slot_TK)

        def materialized():
            return kernels.grouped_mm(kernels.permute(x, plan, backend="triton"), w, plan.counts_E, backend="triton")

        with torch.no_grad():
            err = relative_error(kernels.gather_grouped_mm(x, *args, backend="triton"), materialized())
        fns = {
            "fused_gather": lambda: kernels.gather_grouped_mm(x, *args, backend="triton"),
            "permute_then_gemm": materialized,
            "torch_path": lambda: kernels.gather_grouped_mm(x, *args, backend="torch"),
        }
        with torch.no_grad():
            fwd = run_all(fns, bench)
        fwd_bwd = run_all({k: grads_fn(fn, [x, w], dy) for k, fn in fns.items()}, bench)
        flops = 2.0 * plan.num_rows * D * F_
        add_rates(fwd, flops, "fused_gather")
        add_rates(fwd_bwd, 3 * flops, "fused_gather")
        print_table(f"first expert GEMM forward, {name}: T={T} top-{K} {D}->{F_}, E={E}", fwd, "fused_gather")
        print_table(f"first expert GEMM forward+backward, {name}", fwd_bwd, "fused_gather")
        rows.append({"shape": name, "tokens": T, "top_k": K, "in": D, "out": F_, "experts": E, **err,
                     "results": fwd, "fwd_bwd": fwd_bwd})
    return rows


def bench_layer(shapes, dtype, device, bench):
    rows = []
    for name, T, K, D, F_, E in shapes:
        torch.manual_seed(0)
        with torch.device(device):     # initialise the weights where they live
            layers = {backend: fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=F_, top_k=K,
                                                       gate=RoundRobinGate, activation="swiglu",
                                                       backend=backend).to(dtype)
                      for backend in ("triton", "torch")}
            dense = SwiGLU(D, K * F_).to(dtype)     # same FLOPs per token: K experts' hidden width
        layers["torch"].load_state_dict(layers["triton"].state_dict())
        x = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(T, D, device=device, dtype=dtype)

        def step(module, inp, grad):
            params = [p for p in module.parameters() if p.requires_grad]
            return grads_fn(lambda: module(inp), [inp] + params, grad)

        def forward(module):
            def run():
                with torch.no_grad():
                    return module(x)
            return run

        try:
            with torch.no_grad():
                err = relative_error(layers["triton"](x), layers["torch"](x))
                with tma(True):
                    err_tma = relative_error(layers["triton"](x), layers["torch"](x))
            err = {**err, **{f"tma_{k}": v for k, v in err_tma.items()}}
        except RuntimeError as error:
            err = {"error": str(error).splitlines()[0][:200]}
        flops = 2.0 * T * K * D * F_ * 3     # SwiGLU experts: D -> 2F and F -> D per routed row
        modules = {"fmoe_triton": layers["triton"], "fmoe_torch": layers["torch"], "dense_ffn": dense}
        fwd = run_all({"fmoe_triton": forward(layers["triton"]), "fmoe_triton_tma": with_tma(forward(layers["triton"])),
                       **{k: forward(m) for k, m in modules.items() if k != "fmoe_triton"}}, bench)
        fwd_bwd = run_all({"fmoe_triton": step(layers["triton"], x, dy),
                           "fmoe_triton_tma": with_tma(step(layers["triton"], x, dy)),
                           **{k: step(m, x, dy) for k, m in modules.items() if k != "fmoe_triton"}}, bench)
        add_rates(fwd, flops, "fmoe_triton")
        add_rates(fwd_bwd, 3 * flops, "fmoe_triton")
        print_table(f"FMoETransformerMLP forward, {name}: T={T} top-{K} D={D} F={F_} E={E}", fwd, "fmoe_triton")
        print_table(f"FMoETransformerMLP forward+backward, {name}", fwd_bwd, "fmoe_triton")
        rows.append({"shape": name, "tokens": T, "top_k": K, "d_model": D, "d_hidden": F_, "experts": E, **err,
                     "fwd": fwd, "fwd_bwd": fwd_bwd})
    return rows


def _tflops(section, shape, name, where):
    for row in section or []:
        if row.get("shape") == shape:
            return row.get(where, {}).get(name, {}).get("tflops")
    return None


def _min_ratio(rows, where, mine, theirs):
    ratios = []
    for row in rows or []:
        a, b = (row.get(where, {}).get(k, {}).get("tflops") for k in (mine, theirs))
        if a and b:
            ratios.append(a / b)
    return min(ratios) if ratios else None


def summarize(payload: dict) -> dict:
    """The headline figures (None where the section did not run or the competitor failed):
    the layer's TFLOP/s (Triton, default kernel) at Qwen3-30B-A3B forward and forward+backward and at
    Mixtral forward; the smallest ratio, over the grouped GEMM shapes, of Triton's forward TFLOP/s to
    torch._grouped_mm's; the smallest ratio, over the layer shapes, of the layer's forward+backward
    TFLOP/s to a dense FFN's of the same FLOPs. The same with FMOE_TRITON_TMA=1 under `*_tma`.
    A --quick payload reads its tiny shape in the models' places and says so ("quick": true)."""
    layer, gemm = payload.get("layer"), list(payload.get("grouped_mm") or [])
    # gpu_check.sh's tma step times Qwen3's GEMM first: it counts when the benchmark did not get there.
    done = {row["shape"] for row in gemm}
    gemm += [row for row in payload.get("checks", {}).get("tma", {}).get("grouped_mm", []) if row["shape"] not in done]
    quick = bool(payload.get("quick"))
    qwen3, mixtral = ("tiny", "tiny") if quick else ("qwen3_30b_a3b", "mixtral_8x7b")
    out = {"quick": quick}
    for suffix, impl in (("", "fmoe_triton"), ("_tma", "fmoe_triton_tma")):
        out["qwen3_30b_a3b_fwd_tflops" + suffix] = _tflops(layer, qwen3, impl, "fwd")
        out["qwen3_30b_a3b_fwd_bwd_tflops" + suffix] = _tflops(layer, qwen3, impl, "fwd_bwd")
        out["mixtral_fwd_tflops" + suffix] = _tflops(layer, mixtral, impl, "fwd")
        out["vs_torch_grouped_mm_min" + suffix] = _min_ratio(gemm, "results", impl.replace("fmoe_", ""),
                                                             "torch_grouped_mm")
        out["layer_vs_dense_ffn" + suffix] = _min_ratio(layer, "fwd_bwd", impl, "dense_ffn")
    out["missing"] = sorted(k for k, v in out.items() if v is None)
    return out


def default_out(device: str) -> Path:
    label = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return RESULTS / f"kernels-{re.sub(r'[^a-z0-9]+', '-', label.lower()).strip('-')}.json"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes: exercises the script, measures nothing")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/kernels-<gpu name>.json)")
    p.add_argument("--merge", action="store_true", help="add the sections to what --out holds (gpu_check.sh)")
    p.add_argument("--sections", default="grouped_mm,fused_gather,layer",
                   help="comma-separated, in order (default: %(default)s)")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.quick:
        p.error("the full benchmark needs a CUDA GPU; use --quick to exercise it on CPU")
    dtype = torch.bfloat16
    bench = timer(args.quick)
    out = args.out or default_out(device)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = json.loads(out.read_text()) if args.merge and out.exists() else {}
    payload.update({"machine": machine(), "device": device, "dtype": str(dtype).replace("torch.", ""),
                    "quick": args.quick, "triton_interpret": interpreting(),
                    "triton_autotune": os.environ.get("FMOE_TRITON_AUTOTUNE", "1") != "0"})
    sections = (("grouped_mm", bench_grouped_mm, QUICK_GEMM, GEMM_SHAPES),
                ("fused_gather", bench_fused_gather, QUICK_GATHER, GATHER_SHAPES),
                ("layer", bench_layer, QUICK_LAYER, LAYER_SHAPES))
    wanted = args.sections.split(",")
    for key, run, quick_shapes, shapes in sorted((s for s in sections if s[0] in wanted),
                                                 key=lambda s: wanted.index(s[0])):
        payload[key] = []
        for shape in quick_shapes if args.quick else shapes:
            payload[key] += run([shape], dtype, device, bench)
            payload["summary"] = summarize(payload)
            write_json(out, payload, indent=2)    # after each shape: a timeout keeps what ran
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
