"""fmoe: Mixture-of-Experts for PyTorch, pure Python + Triton, FastMoE-compatible.

The engine (the layer, its experts, gates, routing, kernels and expert parallelism) is at the top;
the rest is grouped by purpose: `fmoe.app` (the `fmoe` command: training, conversion, checkpoints),
`fmoe.observe` (routing statistics, dashboards, memory and launch counts), `fmoe.perf` (FasterMoE's
performance model), `fmoe.tools`, `fmoe.integrations` (DeepSpeed, Megatron-Core, HF transformers),
`fmoe.fastmoe` (FastMoE's module names) and `fmoe.bench`. The paths from before that grouping and
FastMoE's (`fmoe.stats`, `fmoe.layers`, `fmoe.megatron.*`, ...) still import, as the same modules:
see `fmoe.old_paths`.
"""
from fmoe import old_paths

old_paths.install()     # before any import below, some of which still name old paths

# isort: split
from fmoe.distributed.ddp import DistributedGroupedDataParallel
from fmoe.distributed.interleave import interleave_micro_batches
from fmoe.experts import FMoELinear, GroupedExperts
from fmoe.gates import (BalancedGate, BaseGate, DCGate, FasterGate, GShardGate, NaiveGate, NoisyGate, Routing,
                        SwipeGate, SwitchGate, ZeroGate)
from fmoe.layer import FMoE, collect_aux_loss
from fmoe.load_balancing import end_step, register_bias_update
from fmoe.observe.stats import RoutingStatsMeter, routing_stats
from fmoe.replay import RoutingTrace, record_routing, replay_routing
from fmoe.routing import RoutingPlan
from fmoe.transformer import FMoETransformerMLP, moefy

__version__ = "0.1.0"

__all__ = [
    "FMoE", "FMoETransformerMLP", "FMoELinear", "GroupedExperts", "RoutingPlan", "Routing",
    "BaseGate", "NaiveGate", "NoisyGate", "GShardGate", "SwitchGate", "BalancedGate", "FasterGate",
    "ZeroGate", "DCGate", "SwipeGate", "DistributedGroupedDataParallel",
    "collect_aux_loss", "moefy", "register_bias_update", "end_step", "routing_stats", "RoutingStatsMeter",
    "record_routing", "replay_routing", "RoutingTrace", "interleave_micro_batches",
]


def __getattr__(name):
    # `import fmoe; fmoe.stats`: an old path that nothing imported yet
    return old_paths.attribute(__name__, name)
