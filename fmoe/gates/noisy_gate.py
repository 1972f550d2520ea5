"""FastMoE path `fmoe.gates.noisy_gate`."""
from fmoe.gates.noisy import NoisyGate

__all__ = ["NoisyGate"]
