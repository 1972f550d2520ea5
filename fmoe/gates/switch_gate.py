"""FastMoE path `fmoe.gates.switch_gate`."""
from fmoe.gates.switch import SwitchGate

__all__ = ["SwitchGate"]
