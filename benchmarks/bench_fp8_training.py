"""`fmoe train`'s model trained unquantised and with each FP8 recipe, the same steps, seed and batches (#49;
a benchmark, not a test): both loss curves plotted, the final losses and their relative differences
printed and written as JSON.

    python benchmarks/bench_fp8_training.py --out benchmarks/results/fp8-training-cpu

The model is `fmoe train`'s default (d_model 128, 4 layers, 8 experts of width 256, GShard top-2) on its
default corpus (the Python standard library's sources). On a CPU the baseline runs in float32; on a GPU
it is the bf16 run DeepSeek-V3 compares with. The final loss is the mean of the last `--window` steps'
training losses (one step's loss is one batch's: noisy). The FP8 GEMMs are the torch emulation
(`fmoe.kernels.fp8`), the same quantisation an FP8 tensor core sees.
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write_json_atomic  # noqa: E402

from fmoe.app.cli import main as fmoe_main  # noqa: E402
from fmoe.kernels.fp8 import RECIPES  # noqa: E402


def train(recipe, args, folder: Path) -> list:
    out = folder / (recipe or "unquantised")
    argv = ["train", "--steps", str(args.steps), "--seed", str(args.seed), "--out", str(out), "--no-progress",
            "--log", "none"] + (["--fp8", recipe] if recipe else [])
    if fmoe_main(argv) != 0:
        raise SystemExit(f"fmoe train {' '.join(argv)} failed")
    return json.loads((out / "history.json").read_text())["loss"]


def plot(curves: dict, window: int, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(range(1, len(losses) + 1), smooth, label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of {window} steps)")
    ax.set_title("fmoe train: unquantised and FP8 experts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="a folder for fp8-training.json and fp8-training.png (created)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=20, help="steps averaged for the final loss and the plot")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fmoe-fp8-training-") as folder:
        curves = {"unquantised": train(None, args, Path(folder))}
        for recipe in RECIPES:
            curves[recipe] = train(recipe, args, Path(folder))
    final = {name: sum(losses[-args.window:]) / args.window for name, losses in curves.items()}
    relative = {name: (final[name] - final["unquantised"]) / final["unquantised"] for name in RECIPES}
    print(f"{'run':<12} {'final loss':>10} {'vs unquantised':>15}")
    for name, loss in final.items():
        print(f"{name:<12} {loss:>10.4f} {relative.get(name, 0.0):>+15.2%}")
    plot(curves, args.window, args.out / "fp8-training.png")
    write_json_atomic(args.out / "fp8-training.json", {
        "machine": machine(), "command": " ".join(["python", "benchmarks/bench_fp8_training.py"] + sys.argv[1:]),
        "steps": args.steps, "window": args.window, "seed": args.seed,
        "final_loss": final, "relative_difference": relative,
        "goal": "each FP8 recipe's final loss within 1% of the unquantised run's", "curves": curves})


if __name__ == "__main__":
    main()
