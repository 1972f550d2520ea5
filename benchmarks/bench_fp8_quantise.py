"""Launches and bytes of the FP8 row quantisation, torch's path against the fused Triton quantiser (not a test).

Counted on the CPU with `fmoe.observe.launches`: torch ops by dispatch (each reads its inputs and writes its
outputs whole), the Triton kernel under the interpreter (its bytes the distinct addresses it loads and
stores). At Qwen3-30B-A3B's expert shape (d_model 2048, d_hidden 768, SwiGLU), `--rows` rows (slots) in bf16,
for the two places the experts quantise rows in the forward:

- the up projection's input: the permute's gather, then the quantisation (torch: index_select + the
  quantiser's ops; fused: one launch reading each token row where the slot needs it);
- the down projection's input: SwiGLU, then the quantisation (fused: one launch reading h once).

Prints a table with the ratios and, with --out, writes JSON.

    python benchmarks/bench_fp8_quantise.py --out /tmp/fp8-quantise.json
"""
import argparse
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported: the kernel runs on the CPU

import torch  # noqa: E402

from fmoe.app.files import write_json  # noqa: E402
from fmoe.kernels import fp8  # noqa: E402
from fmoe.kernels.torch_ops import apply_activation  # noqa: E402
from fmoe.kernels.triton_fp8_quantise import quantise_rows  # noqa: E402
from fmoe.observe.launches import counting  # noqa: E402

D_MODEL, D_HIDDEN, TOP_K = 2048, 768, 8


def count(fn) -> dict:
    with counting() as counter:
        fn()
    return {"launches": len(counter.launches), "bytes": sum(lau.bytes for lau in counter.launches)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2048, help="rows (token slots) quantised (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    tokens = max(1, args.rows // TOP_K)
    x = torch.randn(tokens, D_MODEL, generator=g).to(torch.bfloat16)
    token_N = torch.randint(0, tokens, (args.rows,), generator=g)
    h = torch.randn(args.rows, 2 * D_HIDDEN, generator=g).to(torch.bfloat16)
    cases = {
        "up input (gather)": (lambda r: fp8.quantise_activation(x.index_select(0, token_N), r),
                              lambda r: quantise_rows(x, r, rows_N=token_N)),
        "down input (swiglu)": (lambda r: fp8.quantise_activation(apply_activation(h, "swiglu"), r),
                                lambda r: quantise_rows(h, r, "swiglu")),
    }
    rows = []
    print(f"{'recipe':<10} {'rows quantised':<20} {'torch: launches':>16} {'MiB':>8} {'fused: launches':>16} "
          f"{'MiB':>8} {'bytes fused/torch':>18}")
    for recipe in fp8.RECIPES:
        for case, (unfused, fused) in cases.items():
            t, f = count(lambda: unfused(recipe)), count(lambda: fused(recipe))
            row = {"recipe": recipe, "case": case, "torch": t, "fused": f, "bytes_ratio": f["bytes"] / t["bytes"]}
            rows.append(row)
            print(f"{recipe:<10} {case:<20} {t['launches']:>16} {t['bytes'] / 2**20:>8.1f} {f['launches']:>16} "
                  f"{f['bytes'] / 2**20:>8.1f} {row['bytes_ratio']:>18.3f}")
    if args.out:
        write_json(args.out, {"shape": dict(d_model=D_MODEL, d_hidden=D_HIDDEN, rows=args.rows, dtype="bfloat16"),
                              "rows": rows, "torch": torch.__version__})
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
