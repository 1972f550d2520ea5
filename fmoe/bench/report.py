"""What `fmoe bench` shows: terminal tables and the GFLOP/s plots."""
from pathlib import Path
from typing import List

from fmoe.app.files import save_figure
from fmoe.bench.workload import Point

MARKERS = "osv^DPX*h"
AXIS_TITLES = {"num_expert": "experts", "tokens": "tokens", "d_model": "d_model", "top_k": "top-k",
               "skew": "routing skew (Zipf exponent)"}


def _mib(n):
    return "-" if n is None else f"{n / 2**20:.1f}"


def point_table(entry: dict) -> List[str]:
    """Every competitor at one point: times, GFLOP/s, share of peak, memory, drops, agreement."""
    fmoe_gflops = entry["results"].get("fmoe", {}).get("gflops", {}).get("total")
    lines = [f"{'':18s}{'fwd ms':>9s}{'bwd ms':>9s}{'GFLOP/s':>9s}{'% peak':>8s}{'fmoe is':>9s}"
             f"{'saved MiB':>10s}{'peak MiB':>9s}{'dropped':>8s}{'max |diff|':>11s}"]
    for name, r in entry["results"].items():
        speedup = f"{fmoe_gflops / r['gflops']['total']:8.2f}x" if fmoe_gflops else f"{'-':>9s}"
        diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"
        lines.append(f"{name:18s}{r['seconds']['forward'] * 1e3:9.1f}{r['seconds']['backward'] * 1e3:9.1f}"
                     f"{r['gflops']['total']:9.1f}{100 * r['peak_fraction']:7.1f}%{speedup}"
                     f"{_mib(r['saved_bytes']):>10s}{_mib(r['peak_bytes']):>9s}{r['dropped']:8d}{diff:>11s}")
    return lines


def describe(payload: dict) -> str:
    """The device, dtype and kernel backend a result came from."""
    return f"{payload['machine'].get('gpu', payload['device'])}, {payload['dtype']}, backend {payload['backend']}"


def summary_lines(payload: dict, base_entry: dict, names: List[str]) -> List[str]:
    """What the terminal shows: the base point in full, its ratios and targets, then every sweep."""
    peak = payload["peak"]
    lines = [f"fmoe bench on {describe(payload)}; peak {peak['flops'] / 1e9:.0f} GFLOP/s ({peak['source']})"]
    lines += [f"skipped {name}: {reason}" for name, reason in payload["skipped"].items()]
    lines += ["", Point(**payload["base"]).label()] + point_table(base_entry)
    lines += [f"  {key:34s}{value:10.2f}" for key, value in payload["ratios_at_base"].items()]
    lines += [f"  target {t['ratio']} {t['target']}: {t['value']:.2f} {'met' if t['met'] else 'MISSED'}"
              for t in payload["targets"]]
    for axis, indexes in payload["sweeps"].items():
        lines += ["", f"fwd+bwd GFLOP/s along {axis} (dr = dropped slots)"]
        lines += sweep_table(axis, [payload["points"][i] for i in indexes], names)
    return lines


def sweep_table(axis: str, entries: List[dict], names: List[str]) -> List[str]:
    """fwd+bwd GFLOP/s of every competitor along one sweep (and DeepSpeed's drops along the skew)."""
    lines = [f"{AXIS_TITLES[axis]:>10s}" + "".join(f"{n:>18s}" for n in names)]
    for e in entries:
        cells = []
        for n in names:
            r = e["results"].get(n)
            cell = "-" if r is None else f"{r['gflops']['total']:.1f}"
            if r is not None and r["dropped"]:
                cell += f" ({r['dropped']} dr)"
            cells.append(f"{cell:>18s}")
        lines.append(f"{e['point'][axis]:>10g}" + "".join(cells))
    return lines


def plot_sweep(axis: str, entries: List[dict], names: List[str], peak: float, title: str, path: Path) -> Path:
    """fwd+bwd GFLOP/s against one axis, a line per competitor, the device's peak dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [e["point"][axis] for e in entries]
    for name, marker in zip(names, MARKERS):
        pairs = [(e["point"][axis], e["results"][name]["gflops"]["total"]) for e in entries if name in e["results"]]
        if pairs:       # DeepSpeed's two capacities often coincide: dashes keep both lines visible
            ax.plot(*zip(*pairs), marker=marker, linestyle="--" if name.endswith("_default") else "-", label=name)
    ax.axhline(peak / 1e9, color="grey", linestyle="--", label="peak")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{x:g}" for x in xs])
    ax.set_xlabel(AXIS_TITLES[axis])
    ax.set_ylabel("GFLOP/s (forward + backward)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    save_figure(path, fig, dpi=110)
    plt.close(fig)
    return path
