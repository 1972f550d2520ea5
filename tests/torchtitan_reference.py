"""References for the torchtitan tests: torchtitan's own modules in float32, and a per-token loop."""
import contextlib

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def torchtitan_in_input_dtype():
    """torchtitan's experts cast their inputs and weights to bfloat16 whatever the model's dtype (`.bfloat16()`
    in `GroupedExperts.forward`); inside this block that cast is the identity, so torchtitan's own modules
    give the float32 result fmoe is held to."""
    cast = torch.Tensor.bfloat16
    torch.Tensor.bfloat16 = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.bfloat16 = cast


def swiglu_expert(e, x_D, params):
    w1, w2, w3 = params["w1_EFD"][e], params["w2_EDF"][e], params["w3_EFD"][e]
    return (F.silu(x_D @ w1.T) * (x_D @ w3.T)) @ w2.T


def gpt_oss_expert(e, x_D, params, limit):
    h = x_D @ params["mlp1_weight_EGD"][e].T + params["mlp1_bias_EG"][e]
    gate, up = h[0::2], h[1::2]
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return ((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ params["mlp2_weight_EDF"][e].T + params["mlp2_bias_ED"][e]


def per_token_moe(moe_config, params, x_TD, expert_bias_E=None, shared=None, gpt_oss_limit=None):
    """A torchtitan MoE's output token by token from its router config and parameters (names as
    torchtitan's state dict below the MoE), written from torchtitan's documented semantics."""
    router = moe_config
    logits_TE = x_TD @ params["router.gate.weight"].T
    if "router.gate.bias" in params:
        logits_TE = logits_TE + params["router.gate.bias"]
    out = []
    experts = {k[len("routed_experts.inner_experts."):]: v for k, v in params.items()
               if k.startswith("routed_experts.inner_experts.")}
    E = router.num_experts
    for t in range(x_TD.shape[0]):
        s_E = torch.softmax(logits_TE[t], -1) if router.score_func == "softmax" else torch.sigmoid(logits_TE[t])
        choice_E = s_E.detach() + (0 if expert_bias_E is None else expert_bias_E)
        if router.num_expert_groups:
            G = router.num_expert_groups
            group_G = choice_E.view(G, E // G).topk(2, -1).values.sum(-1)
            keep = torch.zeros(G, dtype=torch.bool)
            keep[group_G.topk(router.num_limited_groups).indices] = True
            choice_E = choice_E.view(G, E // G).masked_fill(~keep[:, None], float("-inf")).view(E)
        chosen = choice_E.topk(router.top_k).indices
        w_K = s_E[chosen]
        if router.route_norm:
            w_K = w_K / (w_K.sum() + 1e-20)
        w_K = w_K * router.route_scale
        y = torch.zeros_like(x_TD[t])
        for w, e in zip(w_K, chosen.tolist()):
            y = y + w * (gpt_oss_expert(e, x_TD[t], experts, gpt_oss_limit) if gpt_oss_limit is not None
                         else swiglu_expert(e, x_TD[t], experts))
        out.append(y)
    y_TD = torch.stack(out)
    return y_TD if shared is None else y_TD + shared(x_TD)


def torchtitan_on_cpu():
    """torchtitan picks its device once, at import (`torchtitan.tools.utils.device_type`: the available
    accelerator, else "cuda"), and builds its meshes there; with no accelerator that is "cuda", and
    `ParallelDims.build_mesh` fails in torch.cuda.set_device. On a CPU the modules that read it get "cpu"."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils
    tools_utils.device_type, tools_utils.device_module = "cpu", torch.cpu
    parallel_dims.device_type = "cpu"
    dist_utils.device_type, dist_utils.device_module = "cpu", torch.cpu


@contextlib.contextmanager
def one_process_group(folder):
    """A gloo process group of one rank (torchtitan's ParallelDims builds its meshes over one)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
