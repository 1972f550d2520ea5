"""How fmoe's Triton GEMMs are autotuned: short timings, the winner kept on disk, and every config of
a new shape compiled at once.

Triton's autotuner compiles a config the first time it times it, one after the other: a bf16 SwiGLU
layer's first forward+backward on sm_90 compiles 23 (kernel, config) pairs that way (16.6 s on a
2-core host, `python benchmarks/bench_first_compile.py`). `autotune` hands Triton's autotuner a hook instead: when it
meets a new shape, all the configs it is about to time are compiled together on a thread pool
(Triton's own `AsyncCompileMode`; ptxas and the MLIR passes run outside the GIL), and the timing
then finds them compiled. The launches are the autotuner's own (same arguments, same options), so
the kernels compiled are exactly those it runs. Triton releases without `AsyncCompileMode` (3.0-3.3)
compile one by one, as before. `FMOE_COMPILE_THREADS=1` does too.
"""
import concurrent.futures
import functools
import inspect
import os

import triton

try:
    from triton.runtime._async_compile import AsyncCompileMode, active_mode
except ImportError:     # Triton before 3.4
    AsyncCompileMode = active_mode = None


def _tuning_options() -> dict:
    """Shorter timing per config than Triton's default (25 ms warm-up, 100 ms), and, where Triton has
    it (3.2 and later), the best config kept on disk: a shape an earlier process tuned is not tuned again."""
    params = inspect.signature(triton.autotune).parameters
    if "do_bench" not in params:        # Triton 3.0: the timing as arguments
        return {"warmup": 5, "rep": 20}
    from triton.testing import do_bench
    options = {"do_bench": lambda call, quantiles: do_bench(call, warmup=5, rep=20, quantiles=quantiles)}
    if "cache_results" in params:
        options["cache_results"] = True
    return options


TUNING = _tuning_options()


def compile_threads() -> int:
    """Threads that compile a new shape's configs: FMOE_COMPILE_THREADS, else the CPUs this process may use."""
    value = os.environ.get("FMOE_COMPILE_THREADS", "")
    if value:
        try:
            threads = int(value)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"FMOE_COMPILE_THREADS must be a whole number >= 1, got {value!r}")
        return threads
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@functools.lru_cache(maxsize=None)
def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="fmoe-compile")


def compile_together(fn, args: tuple, meta: dict, configs) -> bool:
    """Compile `fn` for each of `configs` as the autotuner's launch `fn.run(*args, **meta, **config)`
    would, on the pool, and wait for all of them. False (nothing done) where this Triton cannot, where
    one thread is asked for, or inside another AsyncCompileMode (Triton allows one). A config that
    fails to compile is left to fail again, the same way, when the autotuner times it (which scores
    it as unusable)."""
    threads = min(compile_threads(), len(configs))
    if (AsyncCompileMode is None or threads < 2 or not isinstance(fn, triton.runtime.JITFunction)
            or active_mode.get() is not None):
        return False
    with AsyncCompileMode(_pool(threads), ignore_errors=True):
        for config in configs:
            try:
                fn.run(*args, **{**meta, **config.all_kwargs(), "warmup": True})
            except Exception:   # noqa: BLE001 - the timing launch raises it again where the autotuner expects it
                pass
    return True


class CompileTogether(triton.runtime.Autotuner):
    """Triton's autotuner, which compiles the configs of a new shape together before timing them.

    `prune_configs` is called once per new tuning key, just before the configs are timed (and before
    the disk cache is read: when that holds the winner, `_bench` is never called and nothing extra is
    compiled); the first `_bench` of that key compiles them all."""

    def prune_configs(self, kwargs, *rest):
        configs = super().prune_configs(kwargs, *rest)
        self.fmoe_to_compile = configs
        return configs

    def _bench(self, *args, config, **meta):
        configs, self.fmoe_to_compile = getattr(self, "fmoe_to_compile", None), None
        if configs:
            compile_together(self.fn, args, meta, configs)
        return super()._bench(*args, config=config, **meta)


def autotune(kernel, configs, key):
    """`kernel` autotuned over `configs`, keyed on the argument names in `key`, with fmoe's timing."""
    tuner = triton.autotune(configs, key=list(key), **TUNING)(kernel)
    if AsyncCompileMode is not None and type(tuner) is triton.runtime.Autotuner:
        # Triton builds the autotuner (its constructor's arguments change between releases); the
        # subclass only adds two hooks and keeps no state of its own at construction.
        tuner.__class__ = CompileTogether
    return tuner
