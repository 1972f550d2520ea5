"""FastMoE path `fmoe.gates.base_gate`."""
from fmoe.gates.base import BaseGate

__all__ = ["BaseGate"]
