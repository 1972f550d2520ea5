"""NaiveGate: a linear router and top-k, weights a softmax over the chosen logits (FastMoE)."""
from fmoe.gates.router import RouterGate


class NaiveGate(RouterGate):
    """RouterGate with `softmax_after_topk=True` and, as FastMoE, a router bias by default."""

    def __init__(self, d_model, num_expert, world_size=1, top_k=2, gate_bias=True, capacity=None, z_loss_coef=0.0):
        super().__init__(d_model, num_expert, world_size, top_k, softmax_after_topk=True, gate_bias=gate_bias,
                         capacity=capacity, z_loss_coef=z_loss_coef)
