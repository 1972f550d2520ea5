"""The oracle: an MoE layer computed one token and one slot at a time."""
import torch


def per_token_moe(layer, x):
    """sum over k of weight[t, k] * expert_{idx[t, k]}(x[t]), token by token, from the layer's own gate."""
    x_TD = x.reshape(-1, layer.d_model)
    routing = layer.gate.routing(x_TD)
    rows = []
    for t in range(x_TD.shape[0]):
        acc = torch.zeros(layer.d_model, dtype=torch.float32, device=x.device)
        for k in range(routing.expert_idx_TK.shape[1]):
            e = int(routing.expert_idx_TK[t, k])
            if e < 0:
                continue
            y = layer.experts.expert_forward(e, x_TD[t:t + 1])[0]
            acc = acc + routing.weight_TK[t, k].float() * y.float()
        rows.append(acc.to(x.dtype))
    out = torch.stack(rows) if rows else x_TD * 0.0
    return out.reshape(x.shape), routing


def grads_of(module, x, out):
    """Gradients of x and every parameter for the loss sum(out * fixed random weights)."""
    g = torch.Generator().manual_seed(1234)
    probe = torch.randn(out.shape, generator=g).to(out.dtype)
    params = [p for p in module.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out.float() * probe.float()).sum(), [x] + params, allow_unused=True)
    names = ["x"] + [n for n, p in module.named_parameters() if p.requires_grad]
    return {n: (g if g is not None else torch.zeros_like(t)) for n, g, t in zip(names, grads, [x] + params)}
