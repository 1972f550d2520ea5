"""Runs fmoe's autotuned grouped GEMM through Triton's real JIT and autotuner on a machine without a
GPU, and prints, as JSON, every compile and every launch in the order they happened.

A stand-in driver says "sm_90", compiles for real (ptxas included) and launches nothing: it records
which compiled kernel each launch would run. The timing is a stand-in too (each config gets a fixed
time, so the winner is known). Run without TRITON_INTERPRET (the test suite sets it):

    python -m tests.tuning_probe --cache-dir DIR [--threads N]

Phases: "new shape" (a fresh tuning key), then "tuned before" (the process's kernels dropped, as in
a new process: the winner comes from Triton's disk cache of tuning results).
"""
import argparse
import json
import os
import threading
import time

import torch
import triton
import triton.compiler
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

EVENTS = []
LOCK = threading.Lock()
T0 = time.perf_counter()


def record(**event):
    with LOCK:
        EVENTS.append({**event, "at": round(time.perf_counter() - T0, 4)})


class _Utils:
    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

    def load_binary(self, name, kernel, shared, device):
        return None, None, 0, 0, 1024      # module, function, registers, spills, threads per block


class StandInDriver:
    """What Triton's JIT asks of a driver to compile for sm_90 and launch; the launch records."""
    utils = _Utils()

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def launcher_cls(self, src, metadata):
        return lambda *args: record(kind="launch", kernel=metadata.hash, thread=threading.current_thread().name)


def _recording_compile(compile_fn):
    def compile(src, *args, **kwargs):
        start = time.perf_counter() - T0
        kernel = compile_fn(src, *args, **kwargs)
        options = kwargs.get("options") or {}
        record(kind="compile", kernel=kernel.metadata.hash, thread=threading.current_thread().name,
               start=round(start, 4), config=[options.get("num_warps"), options.get("num_stages")])
        return kernel
    return compile


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache-dir", required=True, help="Triton's cache (compiled kernels, tuning results)")
    parser.add_argument("--threads", default=None, help="FMOE_COMPILE_THREADS for this run")
    args = parser.parse_args(argv)
    os.environ["TRITON_CACHE_DIR"] = args.cache_dir
    if args.threads is not None:
        os.environ["FMOE_COMPILE_THREADS"] = args.threads
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET"

    from fmoe.kernels import triton_grouped_mm as gmm
    from fmoe.kernels import triton_tuning

    timed = {}

    def stand_in_bench(call, quantiles=None):
        call()      # the launch the autotuner times: its kernel must be compiled by now
        launch = next(e for e in reversed(EVENTS) if e["kind"] == "launch")
        ms = timed.setdefault(launch["kernel"], 1.0 + len(timed))    # the first config timed wins
        return [ms, ms, ms]

    triton_tuning.TUNING["do_bench"] = stand_in_bench
    triton.compiler.compile = _recording_compile(triton.compiler.compile)
    driver.set_active(StandInDriver())

    # A Qwen3-30B-A3B expert's up projection, on meta tensors (the launch reads shapes and strides).
    T, D, F, E = 256, 2048, 768, 8
    x_ND = torch.empty(T, D, dtype=torch.bfloat16, device="meta")
    w_eDF = torch.empty(E, D, F, dtype=torch.bfloat16, device="meta")
    y_NF = torch.empty(T, F, dtype=torch.bfloat16, device="meta")
    counts_e = torch.empty(E, dtype=torch.int64, device="meta")
    kernel, launch_args, constexprs = gmm.grouped_mm_launch(x_ND, w_eDF, counts_e, None, None, y_NF)
    configs = gmm.gpu_configs("hopper", "16bit")
    phases = {}
    for phase in ("new shape", "tuned before"):
        kernel.device_caches.clear()       # this process's compiled kernels gone, as in a new process
        gmm._tuned.cache_clear()
        tuner = gmm._tuned(kernel, "hopper", "16bit", True, ("I", "O", "GATHER"), None)
        EVENTS.clear()
        tuner[(1,)](*launch_args, **constexprs)
        phases[phase] = {"events": list(EVENTS), "best": str(tuner.best_config)}
    print(json.dumps({"triton": triton.__version__, "tuner": type(tuner).__name__, "configs": len(configs),
                      "threads": triton_tuning.compile_threads(), "phases": phases}))


if __name__ == "__main__":
    main()
