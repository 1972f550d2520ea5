"""Worker bodies for the multi-process tests: each compares against the single-process result."""
import copy

import torch
import torch.distributed as dist
from torch import nn

import fmoe
from fmoe.distributed.checkpoint import load_checkpoint, save_checkpoint
from fmoe.distributed.ddp import DistributedGroupedDataParallel, ignore_expert_parameters_in_ddp, sync_expert_gradients
from fmoe.distributed.groups import make_groups

D, H = 8, 16


def build_pair(gate, top_k, e, world, rank, gate_bias=None, group=None):
    """The same layer twice: all experts in one process, and this rank's share of expert parallelism."""
    torch.manual_seed(0)
    kw = dict(d_model=D, d_hidden=H, top_k=top_k, gate=gate)
    if gate in ("gshard", "switch"):
        kw["gate_kwargs"] = {"capacity": None}
    full = fmoe.FMoETransformerMLP(num_expert=e * world, **kw)
    if gate_bias is not None:
        with torch.no_grad():
            full.gate.gate.proj.bias.copy_(torch.tensor(gate_bias))
    ep = fmoe.FMoETransformerMLP(num_expert=e, world_size=world, moe_group=group, **kw)
    ep.gate.load_state_dict(full.gate.state_dict())
    with torch.no_grad():
        for name, p in ep.experts.named_parameters():
            p.copy_(getattr(full.experts, name)[rank * e:(rank + 1) * e])
    return full.eval(), ep.eval()


def layer_cases(rank, world):
    e = 2
    E = e * world
    hot_first_rank = [4.0] * e + [-4.0] * (E - e)
    one_expert = [8.0] + [-8.0] * (E - 1)
    # (gate, top_k, experts per rank, tokens on each rank, gate bias)
    return [
        ("naive", 2, e, [5 + r for r in range(world)], None),
        ("naive", 3, e, [6] * world, None),
        ("noisy", 2, e, [7] * world, None),
        ("gshard", 2, e, [9] * world, None),
        ("switch", 1, e, [4] * world, None),
        ("balanced", 1, e, [6] * world, None),
        ("naive", 1, 1, [8] * world, None),
        ("naive", 2, e, [0] + [6] * (world - 1), None),        # rank 0 sends no tokens
        ("naive", 2, e, [6] * world, hot_first_rank),          # the other ranks' experts receive none
        ("naive", 1, e, [5] * world, one_expert),              # one expert receives every token
    ]


def check_layer_matches_single_process(rank, world):
    for gate, top_k, e, tokens, bias in layer_cases(rank, world):
        full, ep = build_pair(gate, top_k, e, world, rank, bias)
        g = torch.Generator().manual_seed(42)
        x_all = torch.randn(sum(tokens), D, generator=g)
        probe = torch.randn(sum(tokens), D, generator=g)
        lo, hi = sum(tokens[:rank]), sum(tokens[:rank + 1])
        x_all.requires_grad_(True)
        out_all = full(x_all)
        (out_all * probe).sum().backward()
        x = x_all.detach()[lo:hi].clone().requires_grad_(True)
        out = ep(x)
        (out * probe[lo:hi]).sum().backward()
        ctx = f"{gate} top{top_k} e{e} tokens{tokens} rank{rank}"
        torch.testing.assert_close(out, out_all[lo:hi], atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx} out: {m}")
        torch.testing.assert_close(x.grad, x_all.grad[lo:hi], atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx} dx: {m}")
        for name, p in ep.experts.named_parameters():
            ref = getattr(full.experts, name).grad[rank * e:(rank + 1) * e]
            torch.testing.assert_close(p.grad, ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx} {name}: {m}")
        for (name, p), (_, q) in zip(ep.gate.named_parameters(), full.gate.named_parameters()):
            grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad)
            ref = q.grad if q.grad is not None else torch.zeros_like(q)
            torch.testing.assert_close(grad, ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx} gate {name}: {m}")


class TinyModel(nn.Module):
    def __init__(self, e, world, group=None):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = fmoe.FMoETransformerMLP(num_expert=e, d_model=D, d_hidden=H, top_k=2, world_size=world,
                                           moe_group=group, gate="gshard", gate_kwargs={"capacity": None,
                                                                                        "random_routing": False})
        self.out = nn.Linear(D, 1)

    def forward(self, x):
        return self.out(torch.relu(self.inp(x)) + self.moe(x))


def copy_into_ep(full: TinyModel, ep: TinyModel, ep_rank, e):
    with torch.no_grad():
        for (name, p), (_, q) in zip(ep.named_parameters(), full.named_parameters()):
            p.copy_(q[ep_rank * e:(ep_rank + 1) * e] if getattr(p, "is_moe_expert", False) else q)


def batches(steps, rows):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(rows, D, generator=g), torch.randn(rows, 1, generator=g)) for _ in range(steps)]


def check_training_matches_single_process(rank, world, ep_size, mode):
    groups = make_groups(ep_size)
    e = 4 // ep_size
    torch.manual_seed(1)
    full = TinyModel(4, 1)
    ep_rank = rank % ep_size
    model = TinyModel(e, ep_size, groups.moe_group)
    copy_into_ep(full, model, ep_rank, e)
    rows = 4 * world
    data = batches(2, rows)
    # The single-process run sees the global batch, each rank its own share.
    lo, hi = rank * 4, (rank + 1) * 4
    if mode == "dgdp":
        wrapped = DistributedGroupedDataParallel(model, groups=groups)
        step_model, after = wrapped, wrapped.allreduce_params
    else:
        ignore_expert_parameters_in_ddp(model)
        step_model = nn.parallel.DistributedDataParallel(model)
        after = lambda: sync_expert_gradients(model, groups.expert_dp_group)  # noqa: E731
    train_no_aux(step_model, data, after, lo, hi)
    train_no_aux(full, data, lambda: None, 0, rows, per_rank_chunks=world)
    for (name, p), (_, q) in zip(model.named_parameters(), full.named_parameters()):
        ref = q[ep_rank * e:(ep_rank + 1) * e] if getattr(p, "is_moe_expert", False) else q
        torch.testing.assert_close(p.detach(), ref.detach(), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{mode} ep{ep_size} rank{rank} {name}: {m}")


def train_no_aux(model, data, after_backward, lo, hi, per_rank_chunks=1):
    """Two SGD steps (scale-sensitive, unlike Adam) on mean-squared error; the single-process run averages per-chunk means,
    exactly what the ranks' averaged gradients compute."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        pred = model(x[lo:hi])
        err = ((pred - y[lo:hi]) ** 2).view(per_rank_chunks, -1).mean(1).mean()
        err.backward()
        after_backward()
        opt.step()


def check_mismatch_raises(rank, world):
    layer = fmoe.FMoETransformerMLP(num_expert=2 + rank, d_model=D, d_hidden=H, top_k=2, world_size=world)
    try:
        layer(torch.randn(4, D))
    except ValueError as err:
        assert "disagree" in str(err) and "num_expert=2" in str(err), err
    else:
        raise AssertionError("a mismatched expert count did not raise")


def global_view(model, opt, moe_group=None):
    """Every parameter and Adam state with the experts of all ranks stacked back together."""
    view = {}
    for name, p in model.named_parameters():
        tensors = {"param": p.detach()}
        tensors.update({k: v for k, v in opt.state[p].items()})
        for key, t in tensors.items():
            if getattr(p, "is_moe_expert", False) and t.dim() > 0 and dist.is_initialized():
                parts = [torch.empty_like(t) for _ in range(dist.get_world_size(moe_group))]
                dist.all_gather(parts, t.contiguous(), group=moe_group)
                t = torch.cat(parts)
            view[f"{name}/{key}"] = t.clone()
    return view


def reshard_stage(rank, world, stage, workdir):
    """One stage of 4 -> 2 -> 1 -> 4: load the previous checkpoint, check it bit for bit,
    save it again at this size, then take the next step and check its loss."""
    ep_size = world
    groups = make_groups(ep_size) if dist.is_initialized() else None
    moe_group = groups.moe_group if groups else None
    e = 4 // ep_size
    torch.manual_seed(100 + stage)          # a different init: the checkpoint must overwrite it
    model = TinyModel(e, ep_size, moe_group)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rows = 16
    lo, hi = rank * rows // world, (rank + 1) * rows // world
    data = batches(3, rows)
    sync = (DistributedGroupedDataParallel(model, groups=groups, need_sync=False).allreduce_params
            if groups else (lambda: None))

    def step(x, y):
        opt.zero_grad()
        loss = ((model(x[lo:hi]) - y[lo:hi]) ** 2).mean()
        loss.backward()
        sync()
        opt.step()
        loss = loss.detach()
        if groups:
            dist.all_reduce(loss)
            loss /= world
        return loss.item()

    if stage == 0:
        torch.manual_seed(1)
        full = TinyModel(4, 1)
        copy_into_ep(full, model, rank, e)
        for x, y in data[:2]:
            step(x, y)
        save_checkpoint(f"{workdir}/ckpt0", model, opt, extra={"step": torch.tensor(2)})
        expected = global_view(model, opt, moe_group)
        next_loss = step(*data[2])
        if rank == 0:
            torch.save({"state": expected, "next_loss": next_loss}, f"{workdir}/expected.pt")
        return
    extra = load_checkpoint(f"{workdir}/ckpt{stage - 1}", model, opt, extra_keys=("step",))
    assert int(extra["step"]) == 2
    reference = torch.load(f"{workdir}/expected.pt")
    got = global_view(model, opt, moe_group)
    assert got.keys() == reference["state"].keys(), (sorted(got), sorted(reference["state"]))
    for key, value in reference["state"].items():
        assert torch.equal(got[key], value), f"stage {stage} ep{ep_size}: {key} differs after reload"
    save_checkpoint(f"{workdir}/ckpt{stage}", model, opt, extra={"step": torch.tensor(2)})
    next_loss = step(*data[2])
    assert abs(next_loss - reference["next_loss"]) < 1e-6, (stage, next_loss, reference["next_loss"])


def check_missing_rank_times_out(rank, world):
    import os
    import time
    os.environ["FMOE_CHECK_TIMEOUT"] = "3"
    layer = fmoe.FMoETransformerMLP(num_expert=2, d_model=D, d_hidden=H, top_k=2, world_size=world)
    if rank == 1:
        time.sleep(6)        # never joins the forward
        return
    start = time.time()
    try:
        layer(torch.randn(4, D))
    except RuntimeError as err:
        assert "did not" in str(err) or "not every rank" in str(err), err
        assert time.time() - start < 30
    else:
        raise AssertionError("a missing rank did not raise")


def check_balanced_gate_bias_follows_global_load(rank, world):
    full, ep = build_pair("balanced", 1, 2, world, rank)
    gen = torch.Generator().manual_seed(5)
    x_all = torch.randn(10 * world, D, generator=gen)
    full.train()(x_all)
    ep.train()(x_all[rank * 10:(rank + 1) * 10])
    assert torch.equal(ep.gate.expert_bias_E, full.gate.expert_bias_E), (rank, ep.gate.expert_bias_E)


def check_compiled_layer_matches_eager(rank, world):
    """An expert-parallel layer compiled (graph breaks at the exchange) equals it in eager mode."""
    for gate, top_k in (("naive", 2), ("gshard", 2)):
        _, ep = build_pair(gate, top_k, 2, world, rank)
        # The one-time agreement check with the peers (first forward) is not traceable: run it eagerly.
        with torch.no_grad():
            ep(torch.zeros(1, D))
        eager = copy.deepcopy(ep)
        compiled = torch.compile(ep, backend="aot_eager")
        g = torch.Generator().manual_seed(42 + rank)
        x = torch.randn(5 + rank, D, generator=g)
        probe = torch.randn(5 + rank, D, generator=g)
        outs = []
        for module, run in ((eager, eager), (ep, compiled)):
            x_in = x.clone().requires_grad_(True)
            out = run(x_in)
            (out * probe).sum().backward()
            outs.append((out, x_in.grad, [p.grad for p in module.parameters()]))
        (out_e, dx_e, grads_e), (out_c, dx_c, grads_c) = outs
        torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dx_c, dx_e, atol=1e-5, rtol=1e-5)
        for a, b in zip(grads_c, grads_e):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
