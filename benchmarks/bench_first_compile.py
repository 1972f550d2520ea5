"""The Triton compiles of the default layer's first forward+backward, one by one beside each kernel's
configs together (as `fmoe.kernels.triton_tuning` does), on this machine's CPUs, no GPU needed.

    python benchmarks/bench_first_compile.py                       # bf16 SwiGLU layer, sm_90
    python benchmarks/bench_first_compile.py --target 80 --out /tmp/first-compile.json
    python benchmarks/bench_first_compile.py --quick       # smoke: the first step only

The steps are the launches of a bf16 SwiGLU layer without bias, `recompute="activation"`, in the
order its forward and backward make them (`docs/memory.md`, "The fused layer on a GPU"; on sm_90 the row-reading
GEMMs run the Hopper kernel), each compiled for every config its autotuner times, at a Mixtral-8x7B
shape (`fmoe.tools.aot`). Every compile is fresh (Triton's cache is bypassed). What a GPU host's
first call costs is measured on the GPU (`gpu_check.sh`); this shows the compile share and what
the pool saves of it. Prints a table; writes JSON only to --out.
"""
import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

# (launch name in fmoe.tools.aot, on sm_90, on sm_80): forward, then backward.
STEPS = [("up_act[swiglu]",) * 2, ("tma_grouped_mm", "grouped_mm"), ("gather_sum[weighted]",) * 2,
         ("act_grad[swiglu]",) * 2, ("slot_sums",) * 2, ("weight_grad[gather_dy]",) * 2,
         ("weight_grad[gather]",) * 2, ("tma_grouped_mm[w^T]", "grouped_mm[w^T]"), ("gather_sum",) * 2]


def compile_jobs(target: int, steps=STEPS):
    """[(step name, [(source, options), ...] one per config)] in launch order."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from fmoe.kernels.triton_grouped_mm import generation_of
    from fmoe.tools import aot
    backend = make_backend(GPUTarget("cuda", target, 32))
    launches = {name: (kernel, args, constexprs, family)
                for name, kernel, args, constexprs, family in aot.launches(torch.bfloat16, target=target)}
    jobs_of_steps = []
    for names in steps:
        name = names[0] if target >= 90 else names[1]
        kernel, args, constexprs, family = launches[name]
        jobs = []
        for config in aot.configs_of(family, generation_of(target // 10), "16bit"):
            options = {} if config is None else {**config.kwargs, "num_warps": config.num_warps,
                                                 "num_stages": config.num_stages}
            jobs.append(aot._source(kernel, args, constexprs, options, backend))
        jobs_of_steps.append((name, jobs))
    return jobs_of_steps


def _compile_fresh(target: int):
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    gpu = GPUTarget("cuda", target, 32)

    def compile_one(job):
        source, options = job
        with knobs.compilation.scope():
            knobs.compilation.always_compile = True
            triton.compile(source, target=gpu, options=options.__dict__)
    return compile_one


def run(target: int, threads: int, quick: bool = False) -> dict:
    steps = compile_jobs(target, STEPS[:1] if quick else STEPS)
    compile_one = _compile_fresh(target)
    compile_one(steps[0][1][0])     # Triton's first compile loads its passes: not a step's cost
    rows = []
    with ThreadPoolExecutor(threads) as pool:
        for name, jobs in steps:
            start = time.perf_counter()
            for job in jobs:
                compile_one(job)
            one_by_one = time.perf_counter() - start
            start = time.perf_counter()
            list(pool.map(compile_one, jobs))
            together = time.perf_counter() - start
            rows.append({"step": name, "configs": len(jobs), "one_by_one_s": round(one_by_one, 2),
                         "together_s": round(together, 2)})
    total = {key: round(sum(r[key] for r in rows), 2) for key in ("one_by_one_s", "together_s")}
    return {"target": f"sm_{target}", "dtype": "bfloat16", "layer": "SwiGLU, no bias, recompute=activation",
            "threads": threads, "compiles": sum(r["configs"] for r in rows), "steps": rows, "total": total,
            "together_over_one_by_one": round(total["together_s"] / total["one_by_one_s"], 3),
            "machine": machine()}


def render(result: dict) -> str:
    lines = [f"{result['compiles']} compiles for {result['target']}, {result['threads']} threads",
             f"{'step':<24}{'configs':>8}{'one by one s':>14}{'together s':>12}"]
    lines += [f"{r['step']:<24}{r['configs']:>8}{r['one_by_one_s']:>14.2f}{r['together_s']:>12.2f}"
              for r in result["steps"]]
    total = result["total"]
    lines.append(f"{'total':<24}{result['compiles']:>8}{total['one_by_one_s']:>14.2f}{total['together_s']:>12.2f}"
                 f"   together / one by one = {result['together_over_one_by_one']:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from fmoe.kernels.triton_tuning import compile_threads
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=int, choices=(80, 90), default=90, help="compute capability (default 90)")
    parser.add_argument("--threads", type=int, default=None,
                        help="compile threads (default: FMOE_COMPILE_THREADS, else this process's CPUs)")
    parser.add_argument("--quick", action="store_true", help="the first step only (a smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    threads = args.threads if args.threads is not None else compile_threads()
    if threads < 1:
        parser.error(f"--threads must be >= 1, got {threads}")
    from fmoe.tools import aot
    if aot.COMPILER_IMPORT_ERROR is not None:
        parser.error(f"this Triton lacks the compiler internals the benchmark uses: {aot.COMPILER_IMPORT_ERROR}")
    result = run(args.target, threads, args.quick)
    print(render(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
