"""Forward+backward of one MoE layer, eager beside torch.compile, in one process.

    python benchmarks/bench_compile.py --out benchmarks/results/compile-cpu.json
    python benchmarks/bench_compile.py --quick --reps 1 --gates naive --activations gelu   # smoke: nothing written

Eager runs the CPU's eager path (the experts' MLP fused per expert over host counts); compiled
runs the sync-free path (torch._grouped_mm over device counts, Inductor around it). The first
compiled call (compiling) is timed apart. Prints ms and ratios; writes JSON only to --out.
"""
import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fmoe  # noqa: E402
from common import machine, time_call  # noqa: E402
from fmoe.app.files import write_json  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-hidden", type=int, default=2048)
    p.add_argument("--num-expert", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--gates", default="naive,gshard", help="comma-separated gates (default: %(default)s)")
    p.add_argument("--activations", default="gelu,swiglu", help="comma-separated (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (T=64, D=32, F=64), for a smoke run")
    p.add_argument("--out", default=None, help="JSON path to write (default: print only)")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.d_model, args.d_hidden = 64, 32, 64
    device = "cuda" if torch.cuda.is_available() else "cpu"
    T, D, F_, E, K = args.tokens, args.d_model, args.d_hidden, args.num_expert, args.top_k
    flops = 3 * 2 * (T * K * D * F_ * 2 + T * D * E)
    x = torch.randn(T, D, device=device, requires_grad=True)

    rows = {}
    for activation in args.activations.split(","):
        for gate in args.gates.split(","):
            torch.manual_seed(0)
            kw = dict(num_expert=E, d_model=D, d_hidden=F_, top_k=K, gate=gate, activation=activation)
            eager = fmoe.FMoETransformerMLP(**kw).to(device)
            compiled = torch.compile(copy.deepcopy(eager))

            def step(module):
                return lambda: module(x).sum().backward()

            start = time.perf_counter()
            step(compiled)()
            compile_s = time.perf_counter() - start
            eager_s = time_call(step(eager), reps=args.reps)
            compiled_s = time_call(step(compiled), reps=args.reps)
            rows[f"{activation}/{gate}"] = {
                "eager_ms": eager_s * 1e3, "compiled_ms": compiled_s * 1e3, "first_compiled_call_s": compile_s,
                "eager_gflops": flops / eager_s / 1e9, "compiled_gflops": flops / compiled_s / 1e9,
                "compiled_speedup": eager_s / compiled_s}
    print(f"fwd+bwd, T={T} D={D} F={F_} E={E} top-{K}, {device}, {torch.get_num_threads()} threads")
    print(f"{'':16s}{'eager ms':>10s}{'compiled ms':>13s}{'speedup':>9s}{'compile s':>11s}")
    for name, row in rows.items():
        print(f"{name:16s}{row['eager_ms']:10.1f}{row['compiled_ms']:13.1f}{row['compiled_speedup']:8.2f}x"
              f"{row['first_compiled_call_s']:11.1f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, {"config": vars(args), "machine": machine(), "results": rows}, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
