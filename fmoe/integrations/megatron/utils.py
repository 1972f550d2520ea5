"""FastMoE path `fmoe.megatron.utils`: its Megatron command-line arguments."""
import argparse


def add_fmoe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """FastMoE's argument group: --fmoefy, --fmoe-num-experts (or --num-experts when free),
    --top-k, --balance-loss-weight, --balance-strategy, --hidden-hidden-size."""
    group = parser.add_argument_group(title="fastmoe")
    group.add_argument("--fmoefy", action="store_true")
    try:
        group.add_argument("--num-experts", type=int, default=None)
    except argparse.ArgumentError:
        group.add_argument("--fmoe-num-experts", type=int, default=None)
    group.add_argument("--top-k", type=int, default=2)
    group.add_argument("--balance-loss-weight", type=float, default=1)
    group.add_argument("--balance-strategy", type=str, default=None)
    group.add_argument("--hidden-hidden-size", type=int, default=None)
    return parser


def megatron_args():
    """Megatron-LM's global arguments when its training package is installed, else None
    (Megatron-Core alone has no global arguments)."""
    try:
        from megatron.training import get_args
    except ImportError:
        return None
    return get_args()
