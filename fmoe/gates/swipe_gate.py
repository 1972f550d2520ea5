"""FastMoE path `fmoe.gates.swipe_gate`."""
from fmoe.gates.swipe import SwipeGate

__all__ = ["SwipeGate"]
