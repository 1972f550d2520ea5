"""`fmoe simulate`: FasterMoE's performance model over cluster sizes and load distributions.

For each number of GPUs and each distribution of tokens over experts, the modelled step time of
one MoE layer with plain expert parallelism, with shadowing, with the smart schedule, and with
both; printed as a table, written as JSON and plotted.

`--calibrate` measures this machine's constants first (an expert MLP's FLOP/s and fixed time,
the all-to-all, broadcast and reduction bytes/s over 2 gloo ranks, one thread each, as
bench_shadow runs). `--compare FILE` predicts the step times a `benchmarks/bench_shadow.py --out
FILE` run measured (every case, shadowing off, dynamic and forced, from its measured per-rank
counts) and writes their R^2 and a predicted-vs-measured plot; with `--calibrate` the constants
(and the fixed time per routed row) are measured here at that run's shapes, without it the ones
the run measured are used. `--paper` sets FasterMoE's published clusters beside its published
speedups.
"""
import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Dict, List, Optional

import os
import tempfile

import torch

from fmoe.app.files import save_figure, write_json
from fmoe.perf.calibration import calibrate
from fmoe.perf.overlap_model import PREDICTED, cluster_modes, compare_with_bench
from fmoe.perf.perfmodel import PerfModel, dedup_row_share

STRATEGIES = ("plain", "shadow", "schedule", "both")
# FasterMoE (PPoPP'22): shadowing + smart schedule, one MoE layer, V100s.
PAPER = ({"gpus": 16, "net_bw": 50e9 / 8, "published_both": 2.20},
         {"gpus": 64, "net_bw": 100e9 / 8, "published_both": 5.72})
PAPER_FLOPS = 11.5e12           # FastMoE's default V100 throughput (FMOE_FASTER_GLBPLC_GPUTP)


def expert_shares(distribution: str, num_experts: int) -> torch.Tensor:
    """Share of routed slots per expert: `uniform`, `zipf:S` (rank^-S), `hot:P` (expert 0 takes P)."""
    name, _, arg = distribution.partition(":")
    if name == "uniform" and not arg:
        return torch.full((num_experts,), 1.0 / num_experts, dtype=torch.double)
    try:
        value = float(arg)
    except ValueError:
        value = math.nan
    if name == "zipf" and value > 0:
        shares = torch.arange(1, num_experts + 1, dtype=torch.double) ** -value
        return shares / shares.sum()
    if name == "hot" and 0 < value <= 1:
        if num_experts == 1:
            return torch.ones(1, dtype=torch.double)
        shares = torch.full((num_experts,), (1 - value) / (num_experts - 1), dtype=torch.double)
        shares[0] = value
        return shares
    raise ValueError(f"--dist must be uniform, zipf:S (S > 0) or hot:P (0 < P <= 1), got {distribution!r}")


def simulate_one(model: PerfModel, gpus: int, experts_per_gpu: int, tokens_per_gpu: int, top_k: int,
                 distribution: str, group_size: int, exchange: str = "slot") -> dict:
    """`exchange`: "slot" (one row per routed slot) or "rank" (deduplicated: its traffic is the
    rows of distinct (token, rank) pairs, scheduled or not)."""
    shares_E = expert_shares(distribution, gpus * experts_per_gpu)
    counts_WE = (tokens_per_gpu * top_k * shares_E).expand(gpus, -1)
    steps = math.ceil(gpus / group_size)
    share_W = dedup_row_share(shares_E, top_k, gpus) if exchange == "rank" else None
    received_W = counts_WE.sum(0).reshape(gpus, -1).sum(1)      # rows each GPU's experts receive
    shadowed = model.choose_shadowed(counts_WE, row_share_W=share_W)
    shadowed_scheduled = model.choose_shadowed(counts_WE, steps, row_share_W=share_W)
    times = {
        "plain": model.layer_time(counts_WE, row_share_W=share_W),
        "shadow": model.layer_time(counts_WE, shadowed, row_share_W=share_W),
        "schedule": model.layer_time(counts_WE, schedule_steps=steps, row_share_W=share_W),
        "both": model.layer_time(counts_WE, shadowed_scheduled, steps, row_share_W=share_W),
    }
    return {"gpus": gpus, "distribution": distribution, "exchange": exchange, "seconds": times,
            "busiest_rows": float(received_W.max()),
            "speedup": {k: times["plain"] / v for k, v in times.items()},
            "rows_vs_slot": 1.0 if share_W is None else float((share_W * received_W).sum() / received_W.sum()),
            "shadowed_experts": len(shadowed), "shadowed_experts_with_schedule": len(shadowed_scheduled)}


def plot(rows: List[dict], distributions: List[str], path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(distributions), figsize=(5 * len(distributions), 4), squeeze=False)
    for ax, dist_name in zip(axes[0], distributions):
        mine = [r for r in rows if r["distribution"] == dist_name]
        # Distinct markers and dashes: strategies that tie (e.g. shadowing under uniform load) stay visible.
        for strategy, style in zip(STRATEGIES, ("o-", "s--", "^:", "x-.")):
            ax.plot([r["gpus"] for r in mine], [r["seconds"][strategy] * 1e3 for r in mine], style, label=strategy)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(dist_name)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("modelled layer step (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    save_figure(path, fig, dpi=110)
    plt.close(fig)


# The constants a calibration measures, as bench_shadow's JSON and compare.json name them.
CONSTANTS = ("flops", "net_bandwidth", "overhead_per_row", "time_per_expert", "pull_bandwidth", "push_bandwidth",
             "shadow_time_per_expert", "expert_seconds")


def constants_of(model: PerfModel) -> dict:
    return {name: getattr(model, name) for name in CONSTANTS}


def describe(c: dict) -> str:
    def gbs(v):
        return "W_net" if v is None else f"{v / 1e9:.2f} GB/s"
    return (f"{c['flops'] / 1e9:.1f} GFLOP/s, all-to-all {c['net_bandwidth'] / 1e9:.3f} GB/s, "
            f"{c.get('overhead_per_row', 0.0) * 1e6:.2f} us per row, {c.get('time_per_expert', 0.0) * 1e3:.1f} ms per "
            f"expert, pull {gbs(c.get('pull_bandwidth'))}, push {gbs(c.get('push_bandwidth'))}"
            + ("" if c.get("shadow_time_per_expert") is None
               else f", {c['shadow_time_per_expert'] * 1e3:.1f} ms per shadowed expert")
            + ("" if c.get("expert_seconds") is None
               else "; one expert: " + ", ".join(f"{rows:g} rows {t * 1e3:.1f} ms" for rows, t in c["expert_seconds"])))


def _calibrate_rank(rank, world, store, d_model, d_hidden, tokens, num_expert, keep_freed_memory, queue):
    import torch.distributed as dist
    if keep_freed_memory:
        from fmoe.observe import cpu_memory
        cpu_memory.keep_freed_memory()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = calibrate(PerfModel(d_model, d_hidden), size=tokens or 512, tokens=tokens, num_expert=num_expert)
    if rank == 0:
        queue.put(constants_of(model))
    dist.barrier()
    dist.destroy_process_group()


def calibrate_here(d_model: int, d_hidden: int, tokens: int = 0, num_expert: int = 1,
                   keep_freed_memory: bool = False) -> dict:
    """The model's constants (CONSTANTS) measured on 2 gloo ranks of this machine, one thread
    each, for these shapes and `num_expert` experts per rank (the per-row overhead only with
    `tokens` > 0, else 0), with malloc keeping freed memory if asked (fmoe.observe.cpu_memory)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fmoe-calibrate-") as folder:
        procs = [ctx.Process(target=_calibrate_rank, args=(r, 2, os.path.join(folder, "store"), d_model, d_hidden,
                                                           tokens, num_expert, keep_freed_memory, queue))
                 for r in range(2)]
        for proc in procs:
            proc.start()
        result = queue.get()
        for proc in procs:
            proc.join()
    return result


def r_squared(measured: List[float], predicted: List[float]) -> float:
    m, p = torch.tensor(measured, dtype=torch.double), torch.tensor(predicted, dtype=torch.double)
    return float(1 - ((m - p) ** 2).sum() / ((m - m.mean()) ** 2).sum())


def noise_ceiling(points: List[dict]) -> Optional[float]:
    """The R^2 a perfect model could reach on these points, as far as the run itself shows: within
    a case, the variants that shadowed the same experts did the same work, so their measured times
    differ by the machine's noise only; its pooled variance over the measured times' variance is
    the share no model can explain. None when no case has two such variants."""
    groups: Dict[tuple, List[float]] = {}
    for p in points:
        groups.setdefault((p["case"], tuple(p["shadowed"])), []).append(p["measured_s"])
    replicated = [ts for ts in groups.values() if len(ts) > 1]
    if not replicated:
        return None
    noise = sum((len(ts) - 1) * statistics.variance(ts) for ts in replicated) / sum(len(ts) - 1 for ts in replicated)
    return 1 - noise / statistics.pvariance([p["measured_s"] for p in points])


def compare(bench_json: Path, constants: dict, out: Path) -> dict:
    """Predicted against measured step times of a bench_shadow run; R^2, JSON and plot.
    `constants`: the model's measured constants (CONSTANTS; missing ones keep their defaults)."""
    data = json.loads(Path(bench_json).read_text())
    cfg = data["config"]
    model = PerfModel(cfg["d_model"], cfg["d_hidden"], **{k: v for k, v in constants.items() if k in CONSTANTS})
    points = []
    for case, r in data["results"].items():
        counts_WE = torch.tensor(r["counts_WE"], dtype=torch.double)
        hottest = [int(counts_WE.sum(0).argmax())]
        # The experts the run's dynamic layer shadowed (older runs: what this model would choose).
        dynamic = r["shadowed_experts"] if "shadowed_experts" in r else model.choose_shadowed(counts_WE)
        for variant, shadowed in (("off", []), ("dynamic", dynamic), ("forced", hottest)):
            points.append({"case": case, "variant": variant, "shadowed": sorted(shadowed),
                           "measured_s": r[f"{variant}_s"], "predicted_s": model.layer_time(counts_WE, shadowed)})
    r2 = r_squared([p["measured_s"] for p in points], [p["predicted_s"] for p in points])
    ceiling = noise_ceiling(points)
    print(f"predicted vs measured ({bench_json}; {describe(constants_of(model))}):")
    for p in points:
        print(f"  {p['case']:22s}{p['variant']:>8s}{p['measured_s'] * 1e3:10.1f} ms measured"
              f"{p['predicted_s'] * 1e3:10.1f} ms predicted")
    print(f"R^2 = {r2:.3f} over {len(points)} points"
          + ("" if ceiling is None else f"; the noise between variants doing the same work "
             f"(same experts shadowed) caps it at about {ceiling:.3f}"))
    out.mkdir(parents=True, exist_ok=True)
    result = {"bench": str(bench_json), **constants_of(model), "r_squared": r2,
              "r_squared_noise_ceiling": ceiling, "points": points}
    write_json(out / "compare.json", result, indent=2)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 5))
    for variant, marker in (("off", "o"), ("dynamic", "s"), ("forced", "^")):
        mine = [p for p in points if p["variant"] == variant]
        ax.plot([p["measured_s"] * 1e3 for p in mine], [p["predicted_s"] * 1e3 for p in mine], marker,
                linestyle="none", label=f"shadowing {variant}")
    top = max(max(p["measured_s"], p["predicted_s"]) for p in points) * 1e3 * 1.05
    ax.plot([0, top], [0, top], "k--", lw=1, label="predicted = measured")
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title(f"fmoe simulate vs bench_shadow, R^2 = {r2:.3f}")
    ax.legend()
    fig.tight_layout()
    save_figure(out / "compare.png", fig, dpi=110)
    plt.close(fig)
    print(f"wrote {out / 'compare.json'} and {out / 'compare.png'}")
    return result


def paper_rows(args, model: PerfModel, group: int) -> List[dict]:
    """FasterMoE's clusters (V100s; 16 GPUs at 50 Gb/s, 64 at 100 Gb/s) beside its published speedups:
    the shape to reproduce is the gain growing with the cluster (2.20x -> 5.72x, 2.6 times)."""
    rows = []
    for setup in PAPER:
        m = PerfModel(model.d_model, model.d_hidden, flops=PAPER_FLOPS, net_bandwidth=setup["net_bw"],
                      bytes_per_element=model.bytes_per_element)
        for d in args.dist:
            r = simulate_one(m, setup["gpus"], args.experts_per_gpu, args.tokens_per_gpu, args.top_k, d, group)
            r["published_both"] = setup["published_both"]
            rows.append(r)
    print("FasterMoE's published shadowing + schedule speedup beside the model's, per distribution:")
    for r in rows:
        print(f"  {r['gpus']:3d} GPUs {r['distribution']:>10s}: modelled {r['speedup']['both']:5.2f}x, "
              f"published {r['published_both']:.2f}x")
    for d in args.dist:
        small, large = (r["speedup"]["both"] for r in rows if r["distribution"] == d)
        print(f"  {d:>10s}: 16 -> 64 GPUs the modelled gain grows {large / small:.2f} times "
              f"(published {PAPER[1]['published_both'] / PAPER[0]['published_both']:.2f})")
    return rows


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--gpus-per-node", type=int, default=8, help="the smart schedule's groups never exceed a node")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--d-hidden", type=int, default=8192)
    p.add_argument("--tokens-per-gpu", type=int, default=4096)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--experts-per-gpu", type=int, default=1)
    p.add_argument("--flops", type=float, default=11.5e12, help="compute throughput per GPU, FLOP/s")
    p.add_argument("--net-bw", type=float, default=50e9 / 8, help="network bandwidth per GPU, bytes/s")
    p.add_argument("--bytes-per-element", type=int, default=2, help="2 for bf16/fp16 activations, 4 for fp32")
    p.add_argument("--group-size", type=int, default=4, help="ranks per step of the smart schedule")
    p.add_argument("--dist", nargs="+", default=["uniform", "zipf:1.2", "hot:0.5"])
    p.add_argument("--exchange", choices=["slot", "rank"], default="slot",
                   help="the plain and shadowed layer's exchange: one row per slot, or per (token, rank)")
    p.add_argument("--out", default="runs/simulate", help="folder for simulate.json and simulate.png")
    p.add_argument("--calibrate", action="store_true", help="measure --flops and --net-bw on this machine first")
    p.add_argument("--compare", metavar="BENCH_JSON",
                   help="predict a bench_shadow --out run's step times: R^2, compare.json, compare.png")
    p.add_argument("--paper", action="store_true", help="also FasterMoE's 16- and 64-GPU clusters beside its figures")
    p.add_argument("--shared-hidden", type=int, default=0,
                   help="a shared expert of this d_hidden beside the routed ones (what overlap hides the dispatch with)")
    p.add_argument("--latency-us", type=float, default=20.0, help="each collective's fixed cost, microseconds")
    p.add_argument("--overlap-compare", metavar="BENCH_JSON",
                   help="predict a bench_overlap --out run's step time of each overlap mode from its own measured "
                        "parts: overlap-compare.json")


def run(args) -> List[dict]:
    for name in ("gpus_per_node", "d_model", "d_hidden", "tokens_per_gpu", "top_k", "experts_per_gpu", "group_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(g < 1 for g in args.gpus):
        raise ValueError(f"--gpus must be positive, got {args.gpus}")
    if args.overlap_compare:
        return compare_overlap(Path(args.overlap_compare), Path(args.out))
    if args.compare:
        bench = json.loads(Path(args.compare).read_text())
        if args.calibrate:          # this machine's constants at the bench run's shapes
            cfg = bench["config"]
            keep = bool(cfg.get("keep_freed_memory"))      # the allocator the bench ran with
            constants = calibrate_here(cfg["d_model"], cfg["d_hidden"], cfg["tokens"], cfg.get("num_expert", 2) // 2,
                                       keep_freed_memory=keep)
            print(f"calibrated here at the bench's shapes (d_model {cfg['d_model']}, d_hidden {cfg['d_hidden']}, "
                  f"{cfg['tokens']} tokens{', malloc keeping freed memory' if keep else ''}): {describe(constants)}")
        else:                       # the constants the bench run measured for itself
            constants = bench["model"]
        compare(Path(args.compare), constants, Path(args.out))
    elif args.calibrate:
        constants = calibrate_here(args.d_model, args.d_hidden)
        args.flops, args.net_bw = constants["flops"], constants["net_bandwidth"]
        print(f"calibrated here: {args.flops / 1e9:.1f} GFLOP/s, {args.net_bw / 1e9:.3f} GB/s")
    model = PerfModel(args.d_model, args.d_hidden, flops=args.flops, net_bandwidth=args.net_bw,
                      bytes_per_element=args.bytes_per_element)
    group = min(args.group_size, args.gpus_per_node)
    rows = [simulate_one(model, g, args.experts_per_gpu, args.tokens_per_gpu, args.top_k, d, group, args.exchange)
            for d in args.dist for g in args.gpus]
    for r in rows:              # each overlap mode for the busiest worker's rows
        r["overlap"] = cluster_modes(model, r.pop("busiest_rows"), args.tokens_per_gpu, args.shared_hidden,
                                     args.experts_per_gpu, args.latency_us * 1e-6)
    print(f"modelled MoE layer step (ms), d_model {args.d_model}, d_hidden {args.d_hidden}, "
          f"{args.tokens_per_gpu} tokens/GPU, top-{args.top_k}, {args.flops:.3g} FLOP/s, {args.net_bw:.3g} B/s, "
          f"{args.exchange} exchange")
    print(f"{'dist':>10s}{'GPUs':>6s}" + "".join(f"{s:>10s}" for s in STRATEGIES) + f"{'shadow x':>10s}{'sched x':>9s}"
          f"{'both x':>8s}{'rows x slot':>12s}   overlap= none / shared / pipeline / two micro-batches / 1f1b (ms)")
    for r in rows:
        t, s, o = r["seconds"], r["speedup"], r["overlap"]["seconds"]
        print(f"{r['distribution']:>10s}{r['gpus']:>6d}" + "".join(f"{t[k] * 1e3:10.2f}" for k in STRATEGIES)
              + f"{s['shadow']:10.2f}{s['schedule']:9.2f}{s['both']:8.2f}{r['rows_vs_slot']:12.3f}   "
              + " / ".join(f"{o[m] * 1e3:.2f}" for m in PREDICTED) + f" ({r['overlap']['chunks']} chunks)")
    paper = paper_rows(args, model, min(args.group_size, 8)) if args.paper else []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "simulate.json", {"config": vars(args), "results": rows, "paper": paper}, indent=2)
    plot(rows, args.dist, out / "simulate.png")
    print(f"wrote {out / 'simulate.json'} and {out / 'simulate.png'}")
    return rows


def compare_overlap(bench_json: Path, out: Path) -> List[dict]:
    """Each overlap mode's measured step (bench_overlap) beside the timeline's prediction
    (`fmoe.perf.overlap_model`); prints them and writes overlap-compare.json."""
    rows = compare_with_bench(json.loads(bench_json.read_text()))
    print(f"{'ranks':>5} {'mode':>17} {'chunks':>6} {'measured ms':>11} {'predicted ms':>12} {'error':>7}")
    for r in rows:
        print(f"{r['world']:>5} {r['mode']:>17} {r['chunks']:>6} {r['measured_s'] * 1e3:11.1f} "
              f"{r['predicted_s'] * 1e3:12.1f} {r['error']:+7.1%}")
    out.mkdir(parents=True, exist_ok=True)
    worst = max(abs(r["error"]) for r in rows) if rows else None
    write_json(out / "overlap-compare.json", {"bench": str(bench_json), "worst_error": worst, "rows": rows}, indent=2)
    print(f"worst error {worst:.1%}; wrote {out / 'overlap-compare.json'}")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="fmoe simulate", description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
