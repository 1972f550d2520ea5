"""FastMoE path `fmoe.balance`: load-balance metrics of a layer's expert counts."""
import torch

metrics = {
    "coefficient-variation": lambda c_e: torch.std(c_e) / torch.mean(c_e),
    "Lmax-over-Lmin": lambda c_e: (torch.max(c_e) + 1) / (torch.min(c_e) + 1),
    "Lmax-over-Lmean": lambda c_e: torch.max(c_e) / torch.mean(c_e),
}


def reset_balance_profile(balance_dict, num_layers, balance_strategy):
    for key in metrics:
        balance_dict[key] = [None for _ in range(num_layers)]
    if balance_strategy:
        balance_dict[f"{balance_strategy}_loss"] = [None for _ in range(num_layers)]


def update_balance_profile(balance_dict, gate_top_k_idx, _gate_score_top_k, gate_context, layer_idx, num_expert,
                           balance_strategy):
    """Record each metric of layer `layer_idx`'s load (slots per expert; dropped slots not counted)."""
    idx = gate_top_k_idx.reshape(-1)
    c_e = torch.bincount(idx[idx >= 0], minlength=num_expert).float()
    for key, metric in metrics.items():
        if key in balance_dict:
            balance_dict[key][layer_idx] = metric(c_e)
