"""Compile every Triton kernel of fmoe for real NVIDIA GPUs on a machine without one, and report.

Each kernel is compiled as its launch specialises it: the launch builders of `triton_grouped_mm`
and `triton_permute` are called with meta tensors of a Mixtral-8x7B layer (16-byte-aligned
pointers, the launch's strides and constexprs), then bound by Triton's own launcher code, for
every config the autotuner can pick, per target and dtype. A report row holds the registers and
spill bytes ptxas reports, the shared memory the kernel needs, and the tensor-core and copy
instructions in its PTX. Rows are cached by Triton's compile key (source, specialisation, options,
Triton version), so a second run compiles nothing that did not change.

    python -m fmoe.kernels.aot --out benchmarks/results/kernels-aot.json

Triton must not run in its interpreter here (TRITON_INTERPRET unset): this module jits for GPUs.
"""
import argparse
import contextlib
import hashlib
import io
import json
import os
import platform
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.compiler.compiler import get_cache_invalidating_env_vars, get_cache_key
from triton.runtime.jit import create_function_from_signature

from fmoe.kernels import triton_grouped_mm as gmm
from fmoe.kernels import triton_permute as perm

# Per-block shared memory each target allows (opt-in maximum), in bytes.
SHARED_LIMIT = {70: 96 * 1024, 80: 163 * 1024, 90: 227 * 1024}
TARGETS = tuple(SHARED_LIMIT)
# The dtypes checked: fp32 once with TF32 allowed, once without (exact, CUDA cores).
DTYPES = {"bf16": (torch.bfloat16, False), "fp16": (torch.float16, False),
          "fp32-tf32": (torch.float32, True), "fp32-ieee": (torch.float32, False)}
# Mixtral-8x7B experts: tokens, model width, expert width, experts, top-k.
SHAPE = dict(T=4096, D=4096, F=14336, E=8, K=2)
INSTRUCTIONS = {"wgmma": "wgmma.mma_async", "mma.sync": "mma.sync", "cp.async": "cp.async.",
                "cp.async.bulk.tensor": "cp.async.bulk.tensor", "fma": "fma.rn.f32"}


@contextlib.contextmanager
def _tf32(allowed: bool):
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def launches(dtype: torch.dtype, shape: dict = SHAPE):
    """(name, kernel, args, constexprs, autotuned) of every launch the layer makes, on meta tensors."""
    T, D, F, E, K = (shape[k] for k in ("T", "D", "F", "E", "K"))
    N = T * K

    def empty(*size, dt=dtype):
        return torch.empty(*size, dtype=dt, device="meta")

    x_TD, x_ND, h_NF, w_eDF, b_eF = empty(T, D), empty(N, D), empty(N, F), empty(E, D, F), empty(E, F)
    counts_e, token_N = empty(E, dt=torch.int64), empty(N, dt=torch.int64)
    row_of_slot_TK, weight_TK = empty(T, K, dt=torch.int64), empty(T, K)
    gemms = {
        "grouped_mm": gmm.grouped_mm_launch(x_ND, w_eDF, counts_e, None, None, h_NF),
        "grouped_mm+bias": gmm.grouped_mm_launch(x_ND, w_eDF, counts_e, None, b_eF, h_NF),
        "gather_grouped_mm": gmm.grouped_mm_launch(x_TD, w_eDF, counts_e, token_N, None, h_NF),
        "gather_grouped_mm+bias": gmm.grouped_mm_launch(x_TD, w_eDF, counts_e, token_N, b_eF, h_NF),
        # the input gradient (and FMoELinear's forward) reads the weight transposed
        "grouped_mm[w^T]": gmm.grouped_mm_launch(h_NF, w_eDF.transpose(1, 2), counts_e, None, None, x_ND),
        "weight_grad": gmm.weight_grad_launch(x_ND, h_NF, counts_e, None, w_eDF),
        "weight_grad[gather]": gmm.weight_grad_launch(x_TD, h_NF, counts_e, token_N, w_eDF),
    }
    others = {
        "expert_row_sums": gmm.row_sums_launch(h_NF, counts_e, b_eF),
        "permute": perm.permute_launch(x_TD, token_N, x_ND),
        "gather_sum": perm.gather_sum_launch(x_ND, row_of_slot_TK, None, x_TD),
        "gather_sum[weighted]": perm.gather_sum_launch(x_ND, row_of_slot_TK, weight_TK, x_TD),
        "unpermute_backward": perm.unpermute_backward_launch(x_TD, x_ND, weight_TK, token_N, token_N, x_ND,
                                                             weight_TK),
    }
    return ([(name, *launch, True) for name, launch in gemms.items()]
            + [(name, *launch, False) for name, launch in others.items()])


def _source(kernel, args, constexprs, options: dict, backend):
    """(ASTSource, parsed options) as Triton's launcher would build them for these arguments."""
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {**constexprs, **options}
    bound, specialization, _ = binder(*args, **kwargs)
    parsed, signature, constexpr_values, attrs = kernel._pack_args(backend, kwargs, bound, specialization, kwargs)
    return ASTSource(kernel, signature, constexpr_values, attrs), parsed


def _parse_ptxas(log: str) -> dict:
    regs = re.search(r"Used (\d+) registers", log)
    stores = re.search(r"(\d+) bytes spill stores", log)
    loads = re.search(r"(\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_stores": int(stores.group(1)) if stores else 0,
            "spill_loads": int(loads.group(1)) if loads else 0,
            "stack_frame": int(stack.group(1)) if stack else 0}


def _compile(src: ASTSource, target: GPUTarget, options: dict) -> dict:
    """Compile (never from Triton's cache, whose hit would skip ptxas and its log) and measure."""
    log = io.StringIO()
    start = time.perf_counter()
    with knobs.compilation.scope(), knobs.nvidia.scope():
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            try:
                compiled = triton.compile(src, target=target, options=options)
            except Exception as err:    # noqa: BLE001 - any compile failure is a finding to report
                return {"compiled": False, "error": f"{type(err).__name__}: {str(err)[:500]}"}
    ptx = compiled.asm["ptx"]
    return {"compiled": True, **_parse_ptxas(log.getvalue()), "shared": compiled.metadata.shared,
            "instructions": sorted(name for name, text in INSTRUCTIONS.items() if text in ptx),
            "compile_seconds": round(time.perf_counter() - start, 2)}


def _cache_dir() -> str:
    return os.path.join(knobs.cache.dir, "fmoe-aot")


def _cached_compile(src: ASTSource, cc: int, options: dict) -> dict:
    """One report row's measured part, from the cache or a fresh compile."""
    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    key = get_cache_key(src, backend, backend.parse_options(options), env_vars=get_cache_invalidating_env_vars())
    path = os.path.join(_cache_dir(), hashlib.sha256(key.encode()).hexdigest() + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    row = _compile(src, target, options)
    os.makedirs(_cache_dir(), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(row, f)
    os.replace(tmp, path)
    return row


def _check_args(targets, dtypes):
    bad = [cc for cc in targets if cc not in SHARED_LIMIT]
    if bad:
        raise ValueError(f"targets must be compute capabilities among {TARGETS}, got {bad}")
    bad = [name for name in dtypes if name not in DTYPES]
    if bad:
        raise ValueError(f"dtypes must be among {sorted(DTYPES)}, got {bad}")
    if gmm.interpreting():
        raise ValueError("the AOT check compiles for GPUs: unset TRITON_INTERPRET (it makes triton.jit interpret)")


def report(targets=(80, 90), dtypes=tuple(DTYPES), jobs: int = 1) -> list:
    """One dict per (target, dtype, kernel launch, config): what compiling it for that GPU gives.

    Keys: target (sm_XX), dtype, kernel (the launch's name), config (BLOCK_* / warps / stages;
    "fixed" for kernels that are not autotuned), pinned (the config FMOE_TRITON_AUTOTUNE=0 uses),
    compiled, registers, spill_stores, spill_loads, stack_frame, shared (bytes), shared_limit,
    instructions (of INSTRUCTIONS, found in the PTX), compile_seconds (of the first, uncached compile),
    or error when it did not compile. `jobs` processes compile (target, dtype) pairs side by side.
    """
    _check_args(targets, dtypes)
    pairs = [(cc, name) for cc in targets for name in dtypes]
    if jobs > 1 and len(pairs) > 1:
        with ProcessPoolExecutor(jobs) as pool:
            return [row for part in pool.map(_report_pair, *zip(*pairs)) for row in part]
    return [row for pair in pairs for row in _report_pair(*pair)]


def _report_pair(cc: int, dtype_name: str) -> list:
    backend = make_backend(GPUTarget("cuda", cc, 32))
    generation = gmm.generation_of(cc // 10)
    dtype, tf32 = DTYPES[dtype_name]
    rows = []
    with _tf32(tf32):
        mode = gmm.dot_mode(dtype)
        for name, kernel, args, constexprs, autotuned in launches(dtype):
            configs = gmm.gpu_configs(generation, mode) if autotuned else [None]
            for i, config in enumerate(configs):
                options = {**config.kwargs, "num_warps": config.num_warps,
                           "num_stages": config.num_stages} if config else {}
                src, parsed = _source(kernel, args, constexprs, options, backend)
                meta = {k: v for k, v in options.items() if k not in ("num_warps", "num_stages")}
                row = {"target": f"sm_{cc}", "dtype": dtype_name, "kernel": name,
                       "config": {**meta, "warps": parsed.num_warps, "stages": parsed.num_stages} if config else "fixed",
                       "pinned": i == 0, "shared_limit": SHARED_LIMIT[cc]}
                row.update(_cached_compile(src, cc, {"num_warps": parsed.num_warps, "num_stages": parsed.num_stages}))
                rows.append(row)
    return rows


def problems(rows: list) -> list:
    """What the report breaks, one line each: a failed compile, shared memory over the target's
    limit, spills on sm_80 / sm_90, an sm_90 GEMM without wgmma (fp32 without TF32 has none)."""
    found = []
    for r in rows:
        where = f"{r['target']} {r['dtype']} {r['kernel']} {r['config']}"
        if not r["compiled"]:
            found.append(f"{where}: does not compile: {r['error']}")
            continue
        if r["shared"] > r["shared_limit"]:
            found.append(f"{where}: needs {r['shared']} bytes of shared memory, the limit is {r['shared_limit']}")
        if r["target"] in ("sm_80", "sm_90") and (r["spill_stores"] or r["spill_loads"]):
            found.append(f"{where}: spills {r['spill_stores']} bytes (stores), {r['spill_loads']} (loads)")
        if (r["target"] == "sm_90" and r["config"] != "fixed" and r["dtype"] != "fp32-ieee"
                and "wgmma" not in r["instructions"]):
            found.append(f"{where}: no wgmma in the PTX")
    return found


def summary(rows: list) -> dict:
    """Per target and dtype: the most registers, spill bytes and shared memory of any kernel."""
    out = {}
    for r in rows:
        if not r["compiled"]:
            continue
        s = out.setdefault(f"{r['target']} {r['dtype']}", {"max_registers": 0, "max_spill_stores": 0, "max_shared": 0,
                                                            "shared_limit": r["shared_limit"]})
        s["max_registers"] = max(s["max_registers"], r["registers"] or 0)
        s["max_spill_stores"] = max(s["max_spill_stores"], r["spill_stores"])
        s["max_shared"] = max(s["max_shared"], r["shared"])
    return out


def format_rows(rows: list):
    """Report rows as aligned text lines."""
    yield f"{'target':<6} {'dtype':<9} {'kernel':<23} {'config':<34} {'regs':>4} {'spill':>5} {'shared':>7}  instructions"
    for r in rows:
        config = r["config"] if r["config"] == "fixed" else (
            "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} w{warps} s{stages}".format(**r["config"]) + (" (pinned)" if r["pinned"] else ""))
        if not r["compiled"]:
            yield f"{r['target']:<6} {r['dtype']:<9} {r['kernel']:<23} {config:<34} error: {r['error'][:80]}"
            continue
        yield (f"{r['target']:<6} {r['dtype']:<9} {r['kernel']:<23} {config:<34} {r['registers']:>4} "
               f"{r['spill_stores']:>5} {r['shared'] // 1024:>5}KB  {' '.join(r['instructions'])}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe.kernels.aot", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the report (JSON) here; default: print the table only")
    p.add_argument("--targets", default="80,90",
                   help=f"compute capabilities, comma-separated, among {TARGETS} (default: %(default)s)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=1,
                   help="processes compiling (target, dtype) pairs side by side (default: %(default)s)")
    args = p.parse_args(argv)
    # Triton 3.9's default (FP fusion on), said out loud: it silences a warning per compile.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    start = time.perf_counter()
    try:
        rows = report(tuple(int(t) for t in args.targets.split(",")), tuple(args.dtypes.split(",")), args.jobs)
    except ValueError as err:
        p.exit(2, f"{p.prog}: error: {err}\n")
    seconds = time.perf_counter() - start
    for line in format_rows(rows):
        print(line)
    found = problems(rows)
    for line in found:
        print(f"PROBLEM {line}")
    print(f"{len(rows)} compiles checked in {seconds:.1f} s, {len(found)} problems")
    if args.out:
        doc = {"machine": f"{platform.platform()}, {os.cpu_count()} CPUs, no GPU needed (compiled ahead of time)",
               "triton": triton.__version__, "torch": torch.__version__, "shape": SHAPE, "seconds": round(seconds, 1),
               "summary": summary(rows), "problems": found, "rows": rows}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
