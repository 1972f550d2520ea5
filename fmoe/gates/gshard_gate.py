"""FastMoE path `fmoe.gates.gshard_gate`."""
from fmoe.gates.gshard import GShardGate

__all__ = ["GShardGate"]
