"""FastMoE path `fmoe.gates.dc_gate`."""
from fmoe.gates.dc import DCGate

__all__ = ["DCGate"]
