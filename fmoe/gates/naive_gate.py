"""FastMoE path `fmoe.gates.naive_gate`."""
from fmoe.gates.naive import NaiveGate

__all__ = ["NaiveGate"]
