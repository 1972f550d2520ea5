"""fmoe: Mixture-of-Experts for PyTorch, pure Python + Triton, FastMoE-compatible."""
from fmoe.distributed.ddp import DistributedGroupedDataParallel
from fmoe.experts import FMoELinear, GroupedExperts
from fmoe.gates import (BalancedGate, BaseGate, DCGate, FasterGate, GShardGate, NaiveGate, NoisyGate, Routing,
                        SwipeGate, SwitchGate, ZeroGate)
from fmoe.layer import FMoE, collect_aux_loss
from fmoe.load_balancing import end_step, register_bias_update
from fmoe.replay import RoutingTrace, record_routing, replay_routing
from fmoe.routing import RoutingPlan
from fmoe.stats import RoutingStatsMeter, routing_stats
from fmoe.transformer import FMoETransformerMLP, moefy

__version__ = "0.1.0"

__all__ = [
    "FMoE", "FMoETransformerMLP", "FMoELinear", "GroupedExperts", "RoutingPlan", "Routing",
    "BaseGate", "NaiveGate", "NoisyGate", "GShardGate", "SwitchGate", "BalancedGate", "FasterGate",
    "ZeroGate", "DCGate", "SwipeGate", "DistributedGroupedDataParallel",
    "collect_aux_loss", "moefy", "register_bias_update", "end_step", "routing_stats", "RoutingStatsMeter",
    "record_routing", "replay_routing", "RoutingTrace",
]
