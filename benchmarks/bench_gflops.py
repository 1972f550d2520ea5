"""GFLOP/s of one MoE layer beside its competitors: `fmoe bench` writing into benchmarks/results/.

    python benchmarks/bench_gflops.py             # every sweep; see `fmoe bench --help` for the options
    python benchmarks/bench_gflops.py --quick
"""
import sys
from pathlib import Path

from fmoe.bench.run import main

RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    argv = sys.argv[1:]
    given_out = any(a == "--out" or a.startswith("--out=") for a in argv)
    sys.exit(main(argv if given_out else argv + ["--out", str(RESULTS)]))
