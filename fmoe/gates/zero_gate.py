"""FastMoE path `fmoe.gates.zero_gate`."""
from fmoe.gates.zero import ZeroGate

__all__ = ["ZeroGate"]
