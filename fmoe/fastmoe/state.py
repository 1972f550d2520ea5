"""FastMoE's state-dict layout, translated in place to fmoe's while a layer loads.

FastMoE keeps a gate's router as an nn.Linear at `gate.gate` and, in FMoETransformerMLP, one
`_Expert` per expert (`experts.<i>.htoh4.weight` [1, d_hidden, d_model], `.h4toh.*`); fmoe's
router sits at `gate.gate.proj` and its MLP experts are stacked (`experts.w1_eDF` [e, d_model,
d_hidden], ...). FastMoE's fused `_Expert` and user-expert ModuleLists have fmoe's keys already.
"""
import torch

FASTMOE_EXPERT_KEYS = (("htoh4.weight", "w1_eDF"), ("htoh4.bias", "b1_eF"), ("h4toh.weight", "w2_eFD"),
                       ("h4toh.bias", "b2_eD"))


def rename_router(state_dict, prefix: str, gate_keys):
    """`<prefix>gate.gate.weight` -> `<prefix>gate.gate.proj.weight` when the gate has the latter."""
    for name in ("weight", "bias"):
        fastmoe_key = f"{prefix}gate.gate.{name}"
        if fastmoe_key in state_dict and f"gate.{name}" not in gate_keys and f"gate.proj.{name}" in gate_keys:
            state_dict[f"{prefix}gate.gate.proj.{name}"] = state_dict.pop(fastmoe_key)


def stack_experts(state_dict, prefix: str, num_expert: int):
    """`<prefix><i>.htoh4.weight` ([1, out, in] each) -> `<prefix>w1_eDF` ([e, in, out]), and so on."""
    if prefix + "0.htoh4.weight" not in state_dict:
        return
    for fastmoe_key, key in FASTMOE_EXPERT_KEYS:
        names = [f"{prefix}{i}.{fastmoe_key}" for i in range(num_expert)]
        missing = [n for n in names if n not in state_dict]
        if missing:
            raise KeyError(f"FastMoE state dict: {len(missing)} of {num_expert} experts lack {fastmoe_key} "
                           f"(first: {missing[0]}); was it saved with another num_expert per rank?")
        stacked = torch.cat([state_dict.pop(n) for n in names])
        state_dict[prefix + key] = stacked.transpose(1, 2) if key.startswith("w") else stacked
