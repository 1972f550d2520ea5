"""Gates: `x_TD -> Routing`. `make_gate` builds one from a name, a class or an instance."""
from fmoe.gates.balanced import BalancedGate
from fmoe.gates.base import BaseGate, Routing, accepts_keyword
from fmoe.gates.dc import DCGate
from fmoe.gates.faster import FasterGate
from fmoe.gates.gshard import GShardGate
from fmoe.gates.naive import NaiveGate
from fmoe.gates.noisy import NoisyGate
from fmoe.gates.router import PRESETS, RouterGate
from fmoe.gates.swipe import SwipeGate
from fmoe.gates.switch import SwitchGate
from fmoe.gates.zero import ZeroGate

GATES = {
    "naive": NaiveGate,
    "noisy": NoisyGate,
    "gshard": GShardGate,
    "switch": SwitchGate,
    "balanced": BalancedGate,
    "faster": FasterGate,
    "router": RouterGate,
    "zero": ZeroGate,
    "dc": DCGate,
    "swipe": SwipeGate,
}
"""The gate classes by the names `gate=` takes on a layer (`"naive"`, `"gshard"`, `"router"`, ...)."""


def make_gate(gate, d_model: int, num_expert: int, world_size: int, top_k: int, **gate_kwargs) -> BaseGate:
    """A gate from a name of `GATES`, a `BaseGate` subclass (built with these sizes and `gate_kwargs`)
    or an instance (returned as it is), as a layer's `gate=` argument takes it."""
    if isinstance(gate, BaseGate):
        return gate
    if isinstance(gate, str):
        if gate.lower() not in GATES:
            raise ValueError(f"gate must be one of {sorted(GATES)} or a BaseGate class/instance, got {gate!r}")
        gate = GATES[gate.lower()]
    if not (isinstance(gate, type) and issubclass(gate, BaseGate)):
        raise TypeError(f"gate must be a gate name, a BaseGate subclass or instance, got {gate!r}")
    if accepts_keyword(gate, "top_k"):
        # By name: FasterGate's fourth positional argument is FastMoE's `node_rank`.
        return gate(d_model, num_expert, world_size, top_k=top_k, **gate_kwargs)
    return gate(d_model, num_expert, world_size, top_k, **gate_kwargs)


__all__ = ["BaseGate", "Routing", "NaiveGate", "NoisyGate", "GShardGate", "SwitchGate", "BalancedGate",
           "FasterGate", "RouterGate", "PRESETS", "ZeroGate", "DCGate", "SwipeGate", "GATES", "make_gate"]
