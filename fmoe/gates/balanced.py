"""BalancedGate: auxiliary-loss-free load balancing (DeepSeek-V3).

Each expert has a bias added to its score for *selection only*; after every training forward
the bias of an overloaded expert falls and that of an underloaded one rises by
`bias_update_speed` (the load summed over all ranks when distributed; every rank takes part in
that all-reduce, with or without tokens). Gate weights come from the unbiased scores, so no
gradient is bent toward balance and no auxiliary loss is needed.
"""
from fmoe.gates.router import RouterGate


class BalancedGate(RouterGate):
    """RouterGate with sigmoid scores, renormalised top-k and `selection_bias="updated"`."""

    def __init__(self, d_model, num_expert, world_size=1, top_k=2, gate_bias=False, capacity=None,
                 z_loss_coef=0.0, bias_update_speed=1e-3):
        super().__init__(d_model, num_expert, world_size, top_k, score="sigmoid", norm_topk_prob=True,
                         gate_bias=gate_bias, selection_bias="updated", bias_update_speed=bias_update_speed,
                         capacity=capacity, z_loss_coef=z_loss_coef)

    @property
    def expert_bias_E(self):
        """The selection bias under its earlier name."""
        return self.e_score_correction_bias
