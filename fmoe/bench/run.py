"""`fmoe bench`: one MoE layer's GFLOP/s and memory beside its competitors, swept over its shape.

    fmoe bench                        # the issue's point (T=2048 D=512 F=2048 E=8 top-2) and every sweep
    fmoe bench --quick                # tiny shapes, a few seconds
    fmoe bench --sweep num_expert --experts 1,8,64 --competitors fmoe,dense_ffn,deepspeed

Writes <out>/gflops-<device>.json and the plots gflops-<device>-num_expert.png and -tokens.png.
"""
import argparse
import dataclasses
import functools
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from fmoe.app.files import write_json
from fmoe.bench.competitors import COMPETITORS, PER_TOKEN_TOKENS, Unavailable, build_per_token
from fmoe.bench.flops import peak_flops
from fmoe.bench.measure import peak_memory, saved_bytes, time_interleaved
from fmoe.bench.report import describe, plot_sweep, summary_lines
from fmoe.bench.workload import Point, imbalance, make_workload

BASE = Point(tokens=2048, d_model=512, d_hidden=2048, num_expert=8, top_k=2)
SWEEPS = {"num_expert": [1, 2, 4, 8, 16, 32, 64], "tokens": [256, 512, 1024, 2048, 4096, 8192],
          "d_model": [256, 512, 1024], "top_k": [1, 2, 4], "skew": [0, 0.5, 1, 1.5, 2]}
QUICK_BASE = Point(tokens=128, d_model=32, d_hidden=64, num_expert=4, top_k=2)
QUICK_SWEEPS = {"num_expert": [1, 4, 8], "tokens": [64, 128], "skew": [0, 1.5]}
PLOTTED = ("num_expert", "tokens")
# The targets at BASE, per device type: (ratio, bound, whether the ratio must be >= or <= it).
TARGETS = {"cpu": [("fmoe_vs_dense_ffn", 0.9, ">="), ("fmoe_vs_per_token", 100, ">="),
                   ("fmoe_vs_masked_loop", 1.5, ">="), ("fmoe_vs_deepspeed", 3, ">="),
                   ("saved_bytes_fmoe_over_dense_ffn", 1.3, "<=")],
           "cuda": [("peak_bytes_fmoe_over_dense_ffn", 1.3, "<=")]}
MAX_SECONDS = 10.0      # fewer timed runs past this many seconds: the naive loops at 64 experts are that slow
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-2}


def sweep_point(base: Point, axis: str, value) -> Optional[Point]:
    """`base` with one axis changed (d_hidden keeps its ratio to d_model; top_k is capped by the
    experts); None where the combination does not exist (top-k above the experts)."""
    if axis == "num_expert":
        return dataclasses.replace(base, num_expert=value, top_k=min(base.top_k, value))
    if axis == "d_model":
        return dataclasses.replace(base, d_model=value, d_hidden=value * base.d_hidden // base.d_model)
    if axis == "top_k" and value > base.num_expert:
        return None
    return dataclasses.replace(base, **{axis: value})


def agree(y: torch.Tensor, ref: torch.Tensor) -> tuple:
    diff = float((y.detach().float() - ref.detach().float()).abs().max()) if y.numel() else 0.0
    tol = TOLERANCE.get(y.dtype, 1e-4) * max(1.0, float(ref.detach().float().abs().max()))
    return diff, diff <= tol


@dataclasses.dataclass
class Settings:
    names: List[str]            # competitors, fmoe first: its output is what the others must equal
    device: torch.device
    dtype: torch.dtype
    peak: float                 # FLOP/s
    reps: int
    warmup: int
    per_token_tokens: int


def measure_point(point: Point, s: Settings, skipped: Dict[str, str], tick) -> dict:
    """Every competitor at one point: output check against fmoe, saved bytes, times, peak memory."""
    w = make_workload(point, s.device, s.dtype)
    builders = dict(COMPETITORS, per_token=functools.partial(build_per_token, tokens=s.per_token_tokens))
    contenders, results, ref = {}, {}, None
    for name in s.names:
        try:
            c = builders[name](w)
        except Unavailable as err:
            skipped.setdefault(name, str(err))
            tick(name)
            continue
        nbytes, y = saved_bytes(c.fn, c.x, c.params)
        dropped = c.dropped()
        if name == "fmoe":
            ref = y.detach()
        diff = ok = None
        if c.same_rows is not None and name != "fmoe" and dropped == 0:
            diff, ok = agree(y, ref[:c.same_rows])
        contenders[name] = c
        results[name] = {"tokens": c.same_rows or point.tokens, "flops": c.flops, "saved_bytes": nbytes,
                         "peak_bytes": peak_memory(c.fn, c.x, c.grad, c.params), "dropped": dropped,
                         "max_abs_diff": diff, "agrees": ok}
    runs = {name: (c.fn, c.x, c.grad, c.params) for name, c in contenders.items()}
    for name, seconds in time_interleaved(runs, s.warmup, s.reps, MAX_SECONDS).items():
        flops = results[name]["flops"]
        gflops = {phase: flops[phase] / seconds[phase] / 1e9 for phase in ("forward", "backward", "total")}
        results[name].update(seconds={k: seconds[k] for k in gflops}, reps=seconds["reps"], gflops=gflops,
                             peak_fraction=gflops["total"] * 1e9 / s.peak)
        tick(name)
    return {"point": point.as_dict(), "imbalance": imbalance(point), "results": results}


def ratios_at(entry: dict) -> dict:
    """fmoe's throughput over each competitor's, and fmoe's memory over the dense FFN's."""
    r = entry["results"]
    out = {f"fmoe_vs_{n}": r["fmoe"]["gflops"]["total"] / row["gflops"]["total"] for n, row in r.items() if n != "fmoe"}
    for key in ("saved_bytes", "peak_bytes"):
        if "dense_ffn" in r and r["dense_ffn"][key]:
            out[f"{key}_fmoe_over_dense_ffn"] = r["fmoe"][key] / r["dense_ffn"][key]
    return out


def check_targets(ratios: dict, device: torch.device) -> List[dict]:
    checked = []
    for key, target, op in TARGETS[device.type]:
        if key in ratios:
            value = ratios[key]
            checked.append({"ratio": key, "value": value, "target": f"{op} {target}",
                            "met": value >= target if op == ">=" else value <= target})
    return checked


def device_tag(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def machine(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "platform": platform.platform()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    # On a CPU, glibc's malloc maps every block of 32 MiB or more afresh, page faults and all;
    # these settings change that, and with it the timings of allocation-heavy competitors.
    info["allocator_env"] = {k: v for k, v in os.environ.items()
                             if k.startswith("MALLOC_") or k in ("LD_PRELOAD", "THP_MEM_ALLOC_ENABLE")}
    return info


def parse_list(kind):
    def parse(text: str):
        try:
            return [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}")
    return parse


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions (a smoke run)")
    p.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="auto: bfloat16 on CUDA, float32 on a CPU (default: %(default)s)")
    p.add_argument("--out", default="fmoe-bench", help="folder for the JSON and the plots (default: %(default)s)")
    p.add_argument("--sweep", type=parse_list(str), default=None,
                   help=f"axes to sweep, comma-separated, from {','.join(SWEEPS)}, or 'none' (default: all)")
    for axis, flag in (("num_expert", "--experts"), ("tokens", "--tokens"), ("d_model", "--d-model"),
                       ("top_k", "--top-k")):
        p.add_argument(flag, dest=axis, type=parse_list(int), default=None, help=f"values of the {axis} sweep")
    p.add_argument("--skew", dest="skew", type=parse_list(float), default=None,
                   help="values of the routing-skew sweep (Zipf exponent; 0 is balanced)")
    p.add_argument("--competitors", type=parse_list(str), default=None,
                   help=f"comma-separated, from {','.join(COMPETITORS)}; fmoe always runs (default: all)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per competitor (default: 5, quick 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (default: %(default)s)")
    p.add_argument("--per-token-tokens", type=int, default=None,
                   help=f"tokens the per-token loop is timed on (default: {PER_TOKEN_TOKENS}, quick 4)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="no PNG plots")


def resolve_device(text: str) -> torch.device:
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {text}: torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {text!r}")
    return device


def plan_sweeps(args) -> Dict[str, list]:
    sweeps = QUICK_SWEEPS if args.quick else SWEEPS
    axes = list(sweeps) if args.sweep is None else [a for a in args.sweep if a != "none"]
    unknown = [a for a in axes if a not in SWEEPS]
    if unknown:
        raise ValueError(f"--sweep: unknown axes {unknown}; choose from {list(SWEEPS)} or 'none'")
    return {a: getattr(args, a) or sweeps.get(a, SWEEPS[a]) for a in axes}


def run(args) -> int:
    from tqdm import tqdm

    device = resolve_device(args.device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[args.dtype]
    chosen = args.competitors or list(COMPETITORS)
    unknown = [n for n in chosen if n not in COMPETITORS]
    if unknown:
        raise ValueError(f"--competitors: unknown {unknown}; choose from {list(COMPETITORS)}")
    names = ["fmoe"] + [n for n in dict.fromkeys(chosen) if n != "fmoe"]     # every ratio is to fmoe
    reps = args.reps or (1 if args.quick else 5)
    per_token_tokens = args.per_token_tokens or (4 if args.quick else PER_TOKEN_TOKENS)
    if reps < 1 or per_token_tokens < 1 or args.warmup < 0:
        raise ValueError("--reps and --per-token-tokens must be >= 1 and --warmup >= 0")
    base = QUICK_BASE if args.quick else BASE
    sweeps = plan_sweeps(args)
    points = [base] + [p for axis, values in sweeps.items() for v in values
                       if (p := sweep_point(base, axis, v)) is not None]
    points = list(dict.fromkeys(points))            # the base recurs in every sweep: measure it once
    peak = peak_flops(device, dtype, size=512 if args.quick else 2048)
    started = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": os.getloadavg()}

    skipped: Dict[str, str] = {}
    bar = tqdm(total=len(points) * len(names), disable=args.no_progress, desc="fmoe bench", unit="run",
               file=sys.stderr)

    def tick(name):
        bar.set_postfix_str(name)
        bar.update(1)

    settings = Settings(names, device, dtype, peak["flops"], reps, args.warmup, per_token_tokens)
    entries = {}
    for point in points:
        bar.set_description(point.label())
        entries[point] = measure_point(point, settings, skipped, tick)
    bar.close()

    from fmoe import kernels

    shown = [n for n in names if n not in skipped]
    ratios = ratios_at(entries[base])
    targets = check_targets(ratios, device) if base == BASE else []
    payload = {
        "machine": machine(device), "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "backend": kernels.resolve_backend(torch.empty(0, device=device)), "peak": peak,
        "flop_convention": "FastMoE's: forward = 2 * (T*K*D*F*2 + T*D*E), backward = 2 * forward; the dense FFN "
                           "is credited with its own FLOPs (no gate); GFLOP/s uses forward + backward",
        "saved_bytes": "tensors autograd saves for backward during the forward, one count per storage, "
                       "parameters left out",
        "started": started, "finished": {"time": time.strftime("%Y-%m-%d %H:%M:%S"),
                                         "load_average": os.getloadavg()},
        "reps": reps, "warmup": args.warmup, "per_token_tokens": per_token_tokens,
        "base": base.as_dict(), "ratios_at_base": ratios, "targets": targets, "skipped": skipped,
        "points": list(entries.values()),
        "sweeps": {axis: [list(entries).index(p) for v in values if (p := sweep_point(base, axis, v)) is not None]
                   for axis, values in sweeps.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = device_tag(device)
    json_path = out / f"gflops-{tag}.json"
    write_json(json_path, payload, indent=2)

    print("\n".join(summary_lines(payload, entries[base], shown)))
    written = [json_path]
    if not args.no_plots:
        for axis in (a for a in PLOTTED if a in sweeps):
            along = [payload["points"][i] for i in payload["sweeps"][axis]]
            title = f"{describe(payload)}\n{base.label()}, {axis} varied"
            written.append(plot_sweep(axis, along, shown, peak["flops"], title, out / f"gflops-{tag}-{axis}.png"))
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fmoe bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ValueError as err:
        p.exit(2, f"fmoe bench: error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
