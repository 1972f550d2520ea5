"""FastMoE path `fmoe.gates.faster_gate`."""
from fmoe.gates.faster import FasterGate

__all__ = ["FasterGate"]
