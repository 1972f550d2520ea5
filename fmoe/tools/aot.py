"""Compile every Triton kernel of fmoe for real NVIDIA GPUs on a machine without one, and report.

Each kernel is compiled as its launch specialises it: the launch builders of `triton_grouped_mm`
and `triton_permute` are called with meta tensors of a Mixtral-8x7B layer (16-byte-aligned
pointers, the launch's strides and constexprs), then bound by Triton's own launcher code, for
every config the autotuner can pick, per target and dtype. A report row holds the registers and
spill bytes ptxas reports, the shared memory the kernel needs, and the tensor-core and copy
instructions in its PTX. Rows are cached by Triton's compile key (source, specialisation, options,
Triton version), so a second run compiles nothing that did not change.

    python -m fmoe.tools.aot --out benchmarks/results/kernels-aot.json

Triton must not run in its interpreter here (TRITON_INTERPRET unset): this module jits for GPUs.

About 400 lines in one module: a tool run on its own, whose parts (launch specs, compile, cache, report)
serve nothing else.
"""
import argparse
import contextlib
import hashlib
import io
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

try:    # compiling needs Triton 3.9's internals; `launches` (gpu_check.py loads them on a GPU) does not
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.compiler.compiler import get_cache_invalidating_env_vars, get_cache_key
    from triton.runtime.jit import create_function_from_signature
    COMPILER_IMPORT_ERROR = None
except ImportError as err:
    knobs = ASTSource = make_backend = get_cache_invalidating_env_vars = get_cache_key = None
    create_function_from_signature = None
    COMPILER_IMPORT_ERROR = err

from fmoe.kernels import fp8, triton_fp8, triton_fp8_quantise
from fmoe.kernels import triton_grouped_mm as gmm
from fmoe.kernels import triton_grouped_mm_tma as tma
from fmoe.kernels import triton_lean as lean
from fmoe.kernels import triton_permute as perm

# Per-block shared memory each target allows (opt-in maximum), in bytes.
SHARED_LIMIT = {70: 96 * 1024, 80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}
TARGETS = tuple(SHARED_LIMIT)
# Blackwell (sm_100) is checked for the FP8 kernels only: the bf16/fp16/fp32 set is Ampere's and Hopper's.
FP8_ONLY_TARGETS = (100,)
# The dtypes checked: fp32 once with TF32 allowed, once without (exact, CUDA cores).
DTYPES = {"bf16": (torch.bfloat16, False), "fp16": (torch.float16, False),
          "fp32-tf32": (torch.float32, True), "fp32-ieee": (torch.float32, False)}
# The FP8 recipes' kernels (fmoe.kernels.triton_fp8), compiled where the target has FP8 tensor cores (sm_89+).
FP8_DTYPES = {"fp8-blockwise": "blockwise", "fp8-rowwise": "rowwise", "fp8-mxfp8": "mxfp8"}
FP8_MIN_TARGET = 89
# Mixtral-8x7B experts: tokens, model width, expert width, experts, top-k.
SHAPE = dict(T=4096, D=4096, F=14336, E=8, K=2)
INSTRUCTIONS = {"wgmma": "wgmma.mma_async", "mma.sync": "mma.sync", "cp.async": "cp.async.",
                "cp.async.bulk.tensor": "cp.async.bulk.tensor", "fma": "fma.rn.f32",
                "cvt.e4m3": "e4m3x2.f32", "tcgen05": "tcgen05.mma", "block_scale": "block_scale"}        # the hardware's conversion to e4m3 (the FP8 quantiser's stores)
# Opcodes looked for in the SASS of the Hopper (TMA) kernel, disassembled by the wheel's cuobjdump:
# the copy engine's loads and stores, wgmma, cp.async (LDGSTS) and local-memory spills.
SASS_OPCODES = ("UTMALDG", "UTMASTG", "HGMMA", "HMMA", "LDGSTS", "LDL", "STL")


@contextlib.contextmanager
def _tf32(allowed: bool):
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def launches(dtype: torch.dtype, shape: dict = SHAPE, target: int = 90, device: str = "meta"):
    """(name, kernel, args, constexprs, configs) of every launch the layer makes on `target`, on meta
    tensors; configs is "gemm" (the GEMMs' autotune list), a key of `triton_lean.EPILOGUES` (that list
    fitted to a kernel with an activation epilogue), "tma" (the Hopper kernel's) or None (fixed):
    `configs_of` lists them.
    The Hopper kernel (FMOE_TRITON_TMA=1) is listed for sm_90 and dtypes whose dot has tensor cores.
    On device="cuda" the tensors are real (uninitialised), for loading the same kernels on a GPU."""
    T, D, F, E, K = (shape[k] for k in ("T", "D", "F", "E", "K"))
    N = T * K

    def empty(*size, dt=dtype):
        return torch.empty(*size, dtype=dt, device=device)

    x_TD, x_ND, h_NF, w_eDF, b_eF = empty(T, D), empty(N, D), empty(N, F), empty(E, D, F), empty(E, F)
    counts_e, token_N = empty(E, dt=torch.int64), empty(N, dt=torch.int64)
    row_of_slot_TK, weight_TK = empty(T, K, dt=torch.int64), empty(T, K)
    # (x, w, rows, bias, y) of each row-reading GEMM; the input gradient (and FMoELinear's forward)
    # reads the weight transposed.
    row_gemms = {
        "grouped_mm": (x_ND, w_eDF, None, None, h_NF),
        "grouped_mm+bias": (x_ND, w_eDF, None, b_eF, h_NF),
        "gather_grouped_mm": (x_TD, w_eDF, token_N, None, h_NF),
        "gather_grouped_mm+bias": (x_TD, w_eDF, token_N, b_eF, h_NF),
        "grouped_mm[w^T]": (h_NF, w_eDF.transpose(1, 2), None, None, x_ND),
    }
    gemms = {name: gmm.grouped_mm_launch(x, w, counts_e, rows, b, y) for name, (x, w, rows, b, y) in row_gemms.items()}
    gemms["weight_grad"] = gmm.weight_grad_launch(x_ND, h_NF, counts_e, None, w_eDF)
    gemms["weight_grad[gather]"] = gmm.weight_grad_launch(x_TD, h_NF, counts_e, token_N, w_eDF)
    # The fused lean MLP (triton_lean): up GEMM + activation, the activation-gradient GEMM, dW2 reading dy's rows.
    w1g_eDH, h_NH, a_NF, w2_eFD, b_eD = empty(E, D, 2 * F), empty(N, 2 * F), empty(N, F), empty(E, F, D), empty(E, D)
    part_NP = empty(N, triton.cdiv(F, lean.GRAD_BLOCK_N) + 1, dt=torch.float32)
    weight_S = weight_TK.view(-1)
    gemms["weight_grad[gather_dy]"] = gmm.weight_grad_launch(a_NF, x_TD, counts_e, None, w2_eFD, dy_rows_N=token_N)
    fused = {   # name: (launch, its EPILOGUES family)
        "up_act[gelu]": (lean.up_act_launch(x_TD, token_N, counts_e, w_eDF, b_eF, h_NF, h_NF, "gelu"), "up_plain"),
        "up_act[swiglu]": (lean.up_act_launch(x_TD, token_N, counts_e, w1g_eDH, None, h_NH, a_NF, "swiglu"),
                           "up_gated"),
        "act_grad[gelu]": (lean.act_grad_launch(x_TD, token_N, token_N, weight_S, counts_e, w2_eFD, b_eD, h_NF,
                                                h_NF, a_NF, part_NP, "gelu"), "act_grad"),
        "act_grad[swiglu]": (lean.act_grad_launch(x_TD, token_N, token_N, weight_S, counts_e, w2_eFD, None, h_NH,
                                                  h_NH, a_NF, part_NP, "swiglu"), "act_grad"),
    }
    hopper = {}
    if target >= 90 and gmm.dot_mode(dtype) in tma.TMA_CONFIGS:
        hopper = {f"tma_{name}": tma.grouped_mm_tma_launch(x, w, counts_e, rows, b, y)
                  for name, (x, w, rows, b, y) in row_gemms.items()}
    others = {
        "expert_row_sums": gmm.row_sums_launch(h_NF, counts_e, b_eF),
        "permute": perm.permute_launch(x_TD, token_N, x_ND),
        "gather_sum": perm.gather_sum_launch(x_ND, row_of_slot_TK, None, x_TD),
        "gather_sum[weighted]": perm.gather_sum_launch(x_ND, row_of_slot_TK, weight_TK, x_TD),
        "unpermute_backward": perm.unpermute_backward_launch(x_TD, x_ND, weight_TK, token_N, token_N, x_ND,
                                                             weight_TK),
        "expert_row_sums[weighted]": gmm.row_sums_launch(x_TD, counts_e, b_eD, token_N, token_N, weight_S),
        "slot_sums": lean.slot_sums_launch(part_NP, row_of_slot_TK.view(-1), weight_S),
    }
    return ([(name, *launch, "gemm") for name, launch in gemms.items()]
            + [(name, *launch, family) for name, (launch, family) in fused.items()]
            + [(name, *launch, "tma") for name, launch in hopper.items()]
            + [(name, *launch, None) for name, launch in others.items()])


def configs_of(family, generation: str, mode: str, autotune: bool = True) -> list:
    """The configs a launch of this `family` (see `launches`) may run with; [None] for a fixed one."""
    if family == "gemm":
        return gmm.gpu_configs(generation, mode, autotune)
    if family in lean.EPILOGUES:
        fitted = gmm.fit_epilogue(gmm.gpu_configs(generation, mode), *lean.EPILOGUES[family])
        return fitted if autotune else fitted[:1]
    if family == "tma":
        return tma.tma_configs(mode, autotune)
    return [None]


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


def cuobjdump() -> "str | None":
    """The cuobjdump shipped in Triton's wheel (None when this install has none)."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.access(path, os.X_OK) else None


def sass_opcodes(cubin: bytes) -> "list | None":
    """The SASS_OPCODES in a cubin's disassembly (None without cuobjdump)."""
    tool = cuobjdump()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
    return sorted(op for op in SASS_OPCODES if re.search(rf"\b{op}\b", sass))


def _compile(src: ASTSource, target: GPUTarget, options: dict, sass: bool = False) -> dict:
    """Compile (never from Triton's cache, whose hit would skip ptxas and its log) and measure;
    `sass`: also disassemble the cubin (row key "sass": the SASS_OPCODES found, None without cuobjdump)."""
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
    row = {"compiled": True, **_parse_ptxas(log.getvalue()), "shared": compiled.metadata.shared,
           "instructions": sorted(name for name, text in INSTRUCTIONS.items() if text in ptx)}
    if sass:
        row["sass"] = sass_opcodes(compiled.asm["cubin"])
        row["global_scratch"] = compiled.metadata.global_scratch_size
    return {**row, "compile_seconds": round(time.perf_counter() - start, 2)}


def _cache_dir() -> str:
    return os.path.join(knobs.cache.dir, "fmoe-aot")


def _cached_compile(src: ASTSource, cc: int, options: dict, sass: bool = False) -> dict:
    """One report row's measured part, from the cache or a fresh compile."""
    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    key = get_cache_key(src, backend, backend.parse_options(options), env_vars=get_cache_invalidating_env_vars())
    key += "+sass" if sass else ""
    key += "+" + ",".join(sorted(INSTRUCTIONS.values()))      # what a row reports changes with what is looked for
    path = os.path.join(_cache_dir(), hashlib.sha256(key.encode()).hexdigest() + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    row = _compile(src, target, options, sass)
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
    bad = [name for name in dtypes if name not in DTYPES and name not in FP8_DTYPES]
    if bad:
        raise ValueError(f"dtypes must be among {sorted(DTYPES) + sorted(FP8_DTYPES)}, got {bad}")
    if COMPILER_IMPORT_ERROR is not None:
        raise ValueError(f"the AOT check needs the compiler internals of Triton 3.9 ({triton.__version__} here): "
                         f"{COMPILER_IMPORT_ERROR}")
    if gmm.interpreting():
        raise ValueError("the AOT check compiles for GPUs: unset TRITON_INTERPRET (it makes triton.jit interpret)")


def report(targets=(80, 90, 100), dtypes=tuple(DTYPES) + tuple(FP8_DTYPES), jobs: int = 1) -> list:
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


def _report_fp8(cc: int, dtype_name: str) -> list:
    """The FP8 recipe's launches (its pinned config) on a target with FP8 tensor cores; none below sm_89."""
    if cc < FP8_MIN_TARGET:
        return []
    backend = make_backend(GPUTarget("cuda", cc, 32))
    rows = []
    recipe = FP8_DTYPES[dtype_name]
    for name, kernel, args, constexprs, config in triton_fp8.aot_launches(fp8.ACTIVATION_TILE[recipe],
                                                                          fp8.WEIGHT_BLOCK[recipe], SHAPE, target=cc):
        options = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
        src, parsed = _source(kernel, args, constexprs, options, backend)
        row = {"target": f"sm_{cc}", "dtype": dtype_name, "kernel": name,
               "config": {**config.kwargs, "warps": parsed.num_warps, "stages": parsed.num_stages},
               "pinned": True, "shared_limit": SHARED_LIMIT[cc]}
        row.update(_cached_compile(src, cc, {"num_warps": parsed.num_warps, "num_stages": parsed.num_stages}))
        rows.append(row)
    # The fused row quantiser (no tensor cores: "fixed", one config).
    for name, kernel, args, constexprs in triton_fp8_quantise.aot_launches(recipe, SHAPE):
        src, parsed = _source(kernel, args, constexprs, triton_fp8_quantise.OPTIONS, backend)
        row = {"target": f"sm_{cc}", "dtype": dtype_name, "kernel": name, "config": "fixed", "pinned": True,
               "shared_limit": SHARED_LIMIT[cc]}
        row.update(_cached_compile(src, cc, {"num_warps": parsed.num_warps, "num_stages": parsed.num_stages}))
        rows.append(row)
    return rows


def _report_pair(cc: int, dtype_name: str) -> list:
    if dtype_name in FP8_DTYPES:
        return _report_fp8(cc, dtype_name)
    if cc in FP8_ONLY_TARGETS:
        return []
    backend = make_backend(GPUTarget("cuda", cc, 32))
    generation = gmm.generation_of(cc // 10)
    dtype, tf32 = DTYPES[dtype_name]
    rows = []
    with _tf32(tf32):
        mode = gmm.dot_mode(dtype)
        for name, kernel, args, constexprs, family in launches(dtype, target=cc):
            configs = configs_of(family, generation, mode)
            for i, config in enumerate(configs):
                options = {**config.kwargs, "num_warps": config.num_warps,
                           "num_stages": config.num_stages} if config else {}
                src, parsed = _source(kernel, args, constexprs, options, backend)
                meta = {k: v for k, v in options.items() if k not in ("num_warps", "num_stages")}
                row = {"target": f"sm_{cc}", "dtype": dtype_name, "kernel": name,
                       "config": {**meta, "warps": parsed.num_warps, "stages": parsed.num_stages} if config else "fixed",
                       "pinned": i == 0, "shared_limit": SHARED_LIMIT[cc]}
                row.update(_cached_compile(src, cc, {"num_warps": parsed.num_warps, "num_stages": parsed.num_stages},
                                           sass=family == "tma"))
                rows.append(row)
    return rows


@triton.jit
def _descriptor_gather_probe(x_ptr, rows_ptr, y_ptr, T, D, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows of x gathered through a tensor descriptor: what the Hopper kernel would use for x[rows]."""
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[T, D], strides=[D, 1], block_shape=[1, BLOCK_K])
    y_desc = tl.make_tensor_descriptor(y_ptr, shape=[BLOCK_M, BLOCK_K], strides=[BLOCK_K, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    y_desc.store([0, 0], x_desc.gather(tl.load(rows_ptr + tl.arange(0, BLOCK_M)), 0))


def descriptor_gather(cc: int) -> str:
    """Whether a descriptor gather of bf16 rows compiles for sm_`cc` ("compiles", or the error's
    telling line): why the Hopper kernel loads gathered rows with plain loads."""
    src = ASTSource(_descriptor_gather_probe, {"x_ptr": "*bf16", "rows_ptr": "*i32", "y_ptr": "*bf16", "T": "i32",
                                               "D": "i32"}, {"BLOCK_M": 64, "BLOCK_K": 64})
    with knobs.compilation.scope():
        knobs.compilation.always_compile = True
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": 4})
            except Exception as err:    # noqa: BLE001 - the failure is the finding
                found = re.search(r"error\s*:\s*(.*requires.*)", str(err))
                return found.group(1).strip() if found else f"{type(err).__name__}: {str(err)[:300]}"
    return "compiles, " + ("tile::gather4" if "gather4" in compiled.asm["ptx"] else "without gather4")


def problems(rows: list) -> list:
    """What the report breaks, one line each: a failed compile, shared memory over the target's
    limit, spills on sm_80 / sm_90, an sm_90 GEMM without wgmma (fp32 without TF32 has none), a
    Hopper (TMA) kernel without the copy engine in its PTX or without UTMALDG / UTMASTG / HGMMA in its
    SASS (checked where cuobjdump exists)."""
    found = []
    for r in rows:
        where = f"{r['target']} {r['dtype']} {r['kernel']} {r['config']}"
        if not r["compiled"]:
            found.append(f"{where}: does not compile: {r['error']}")
            continue
        if r["shared"] > r["shared_limit"]:
            found.append(f"{where}: needs {r['shared']} bytes of shared memory, the limit is {r['shared_limit']}")
        if r["target"] in ("sm_80", "sm_90", "sm_100") and (r["spill_stores"] or r["spill_loads"]):
            found.append(f"{where}: spills {r['spill_stores']} bytes (stores), {r['spill_loads']} (loads)")
        if (r["target"] == "sm_90" and r["config"] != "fixed" and r["dtype"] != "fp32-ieee"
                and "wgmma" not in r["instructions"]):
            found.append(f"{where}: no wgmma in the PTX")
        if r["target"] == "sm_100" and r["config"] != "fixed" and "tcgen05" not in r["instructions"]:
            found.append(f"{where}: no tcgen05.mma (Blackwell's tensor cores) in the PTX")
        if r["kernel"].startswith("tma_"):
            if "cp.async.bulk.tensor" not in r["instructions"]:
                found.append(f"{where}: no cp.async.bulk.tensor (TMA) in the PTX")
            missing = [op for op in ("UTMALDG", "UTMASTG", "HGMMA") if r["sass"] is not None and op not in r["sass"]]
            if missing:
                found.append(f"{where}: no {', '.join(missing)} in the SASS")
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
    yield f"{'target':<6} {'dtype':<9} {'kernel':<26} {'config':<34} {'regs':>4} {'spill':>5} {'shared':>7}  instructions"
    for r in rows:
        config = r["config"] if r["config"] == "fixed" else (
            "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} w{warps} s{stages}".format(**r["config"]) + (" (pinned)" if r["pinned"] else ""))
        if not r["compiled"]:
            yield f"{r['target']:<6} {r['dtype']:<9} {r['kernel']:<26} {config:<34} error: {r['error'][:80]}"
            continue
        sass = f" | SASS {' '.join(r['sass'])}" if r.get("sass") else ""
        yield (f"{r['target']:<6} {r['dtype']:<9} {r['kernel']:<26} {config:<34} {r['registers']:>4} "
               f"{r['spill_stores']:>5} {r['shared'] // 1024:>5}KB  {' '.join(r['instructions'])}{sass}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe.tools.aot", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the report (JSON) here; default: print the table only")
    p.add_argument("--targets", default="80,90,100",
                   help=f"compute capabilities, comma-separated, among {TARGETS} (default: %(default)s)")
    p.add_argument("--dtypes", default=",".join([*DTYPES, *FP8_DTYPES]), help="comma-separated (default: %(default)s)")
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
               "summary": summary(rows), "problems": found,
               "descriptor_gather": {f"sm_{cc}": descriptor_gather(cc) for cc in (90, 100)},
               "cuobjdump": cuobjdump() is not None, "rows": rows}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
