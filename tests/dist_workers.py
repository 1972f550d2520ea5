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


def build_pair(gate, top_k, e, world, rank, gate_bias=None, group=None, ep_kwargs=None, **layer_kwargs):
    """The same layer twice: all experts in one process, and this rank's share of expert parallelism
    (`ep_kwargs`: options of that one alone)."""
    torch.manual_seed(0)
    kw = dict(d_model=D, d_hidden=H, top_k=top_k, gate=gate, **layer_kwargs)
    if gate in ("gshard", "switch"):
        kw["gate_kwargs"] = {"capacity": None}
    full = fmoe.FMoETransformerMLP(num_expert=e * world, **kw)
    if gate_bias is not None:
        with torch.no_grad():
            full.gate.gate.proj.bias.copy_(torch.tensor(gate_bias))
    ep = fmoe.FMoETransformerMLP(num_expert=e, world_size=world, moe_group=group, **kw, **(ep_kwargs or {}))
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


def check_layer_matches_single_process(rank, world, exchange="slot", ranks_per_node=None, max_tokens_per_rank=None):
    """`max_tokens_per_rank`: the sync-free exchange with that bound (no case reaches it)."""
    bounded = {} if max_tokens_per_rank is None else dict(sync_free=True, max_tokens_per_rank=max_tokens_per_rank)
    for gate, top_k, e, tokens, bias in layer_cases(rank, world):
        full, ep = build_pair(gate, top_k, e, world, rank, bias, exchange=exchange, ranks_per_node=ranks_per_node,
                              ep_kwargs=bounded)
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
        ctx = f"{exchange} exchange (bound {max_tokens_per_rank}): {gate} top{top_k} e{e} tokens{tokens} rank{rank}"
        torch.testing.assert_close(out, out_all[lo:hi], atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx} out: {m}")
        assert ep.num_overflowed == 0, ctx
        torch.testing.assert_close(x.grad, x_all.grad[lo:hi], atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx} dx: {m}")
        for name, p in ep.experts.named_parameters():
            ref = getattr(full.experts, name).grad[rank * e:(rank + 1) * e]
            torch.testing.assert_close(p.grad, ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx} {name}: {m}")
        for (name, p), (_, q) in zip(ep.gate.named_parameters(), full.gate.named_parameters()):
            grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad)
            ref = q.grad if q.grad is not None else torch.zeros_like(q)
            torch.testing.assert_close(grad, ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx} gate {name}: {m}")


def check_recompute_modes_match_single_process(rank, world):
    """Each recompute mode and activation, expert-parallel, equals one process running the default."""
    for activation in ("gelu", "swiglu"):
        ref_full, _ = build_pair("naive", 2, 2, world, rank, activation=activation)
        for mode in ("activation", "experts", "none"):
            _, ep = build_pair("naive", 2, 2, world, rank, activation=activation, recompute=mode)
            g = torch.Generator().manual_seed(42)
            x_all = torch.randn(6 * world, D, generator=g, requires_grad=True)
            probe = torch.randn(6 * world, D, generator=g)
            out_all = ref_full(x_all)
            (out_all * probe).sum().backward()
            x = x_all.detach()[6 * rank:6 * (rank + 1)].clone().requires_grad_(True)
            out = ep(x)
            (out * probe[6 * rank:6 * (rank + 1)]).sum().backward()
            torch.testing.assert_close(out, out_all[6 * rank:6 * (rank + 1)], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(x.grad, x_all.grad[6 * rank:6 * (rank + 1)], atol=1e-5, rtol=1e-5)
            for name, p in ep.experts.named_parameters():
                ref = getattr(ref_full.experts, name).grad[rank * 2:(rank + 1) * 2]
                torch.testing.assert_close(p.grad, ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{mode} {name}: {m}")
            ref_full.zero_grad()


def check_autocast_matches_single_process(rank, world):
    """Under bf16 autocast, fp32 input: the rows travel in fp32, the expert outputs come back in
    bf16; output and gradients as one process holding every expert under autocast."""
    full, ep = build_pair("naive", 2, 2, world, rank)
    g = torch.Generator().manual_seed(3)
    x_all = torch.randn(6 * world, D, generator=g)
    probe = torch.randn(6 * world, D, generator=g)
    lo, hi = rank * 6, (rank + 1) * 6
    x_all.requires_grad_(True)
    x = x_all.detach()[lo:hi].clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_all, out = full(x_all), ep(x)
    (out_all.float() * probe).sum().backward()
    (out.float() * probe[lo:hi]).sum().backward()
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    torch.testing.assert_close(out, out_all[lo:hi], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(x.grad, x_all.grad[lo:hi], atol=1e-2, rtol=1e-2)
    for name, p in ep.experts.named_parameters():
        assert p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, getattr(full.experts, name).grad[rank * 2:(rank + 1) * 2],
                                   atol=2e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}")


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


def expect_disagreement(layer, field: str):
    """The layer's first forward raises on this rank, naming the field the ranks disagree on."""
    try:
        layer(torch.randn(4, D))
    except ValueError as err:
        assert "disagree" in str(err) and field in str(err), err
    else:
        raise AssertionError(f"ranks disagreeing on {field} did not raise")


def check_mismatch_raises(rank, world):
    expect_disagreement(fmoe.FMoETransformerMLP(num_expert=2 + rank, d_model=D, d_hidden=H, top_k=2,
                                                world_size=world), "num_expert=2")


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
    full.gate.balance_group = "local"       # the one-process reference sees the whole batch itself
    full.train()(x_all)
    ep.train()(x_all[rank * 10:(rank + 1) * 10])
    full.gate.end_step()
    ep.gate.end_step()
    assert ep.gate.expert_bias_E.abs().sum() > 0
    assert torch.equal(ep.gate.expert_bias_E, full.gate.expert_bias_E), (rank, ep.gate.expert_bias_E)


# --- DistributedGroupedDataParallel: FastMoE's semantics and fmoe's scaling ---------------------

class ReplicatedExpertsModel(nn.Module):
    """FastMoE's data-parallel recipe: every rank holds every expert, tagged "dp"."""

    def __init__(self, expert_dp_comm="dp", world_size=1, group=None, num_expert=4):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = fmoe.FMoETransformerMLP(num_expert=num_expert, d_model=D, d_hidden=H, top_k=2, world_size=world_size,
                                           moe_group=group, expert_dp_comm=expert_dp_comm)
        self.out = nn.Linear(D, 1)

    def forward(self, x):
        return self.out(self.moe(torch.relu(self.inp(x))))


def gathered(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def check_dgdp_replicas_stay_equal(rank, world):
    torch.manual_seed(10 + rank)                    # ranks start apart: need_sync must bring them together
    model = fmoe.DistributedGroupedDataParallel(ReplicatedExpertsModel())
    single = copy.deepcopy(model.module)
    rows = 4 * world
    data = batches(4, rows)
    train_no_aux(model, data, model.allreduce_params, rank * 4, (rank + 1) * 4)
    train_no_aux(single, data, lambda: None, 0, rows, per_rank_chunks=world)
    for name, p in model.module.named_parameters():
        parts = gathered(p.detach())
        assert all(torch.equal(parts[0], q) for q in parts[1:]), f"rank replicas of {name} differ"
        torch.testing.assert_close(p.detach(), dict(single.named_parameters())[name].detach(), atol=1e-6, rtol=1e-5,
                                   msg=lambda m: f"{name} vs one process on the global batch: {m}")


def grads_after(make_model, wrap, x, seed=3, **allreduce_kwargs):
    """Gradients of one backward on this rank's batch, synced by `wrap(model).allreduce_params`."""
    torch.manual_seed(seed)
    model = make_model()
    synced = wrap(model)
    (synced(x) ** 2).mean().backward()
    synced.allreduce_params(**allreduce_kwargs)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def check_dgdp_groups_and_keywords_agree(rank, world):
    import warnings
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(rank))
    DGDP = fmoe.DistributedGroupedDataParallel
    # The replicated recipe: fmoe's groups= and FastMoE's keywords reduce every bucket alike.
    by_groups = grads_after(ReplicatedExpertsModel, lambda m: DGDP(m, groups=make_groups(1)), x)
    by_keywords = grads_after(ReplicatedExpertsModel, lambda m: DGDP(m, dp_group=None, gate_group=None,
                                                                      world_group=None), x)
    for name, g in by_groups.items():
        assert torch.equal(g, by_keywords[name]), name
    # Replicated experts tagged "none": fmoe's scaling averages them; FastMoE's leaves them (and warns).
    none_tagged = lambda: ReplicatedExpertsModel(expert_dp_comm="none")  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        left_alone = grads_after(none_tagged, DGDP, x)
    assert any("will not be synchronised" in str(w.message) for w in caught), [str(w.message) for w in caught]
    averaged = grads_after(none_tagged, lambda m: DGDP(m, groups=make_groups(1)), x)
    for name, g in averaged.items():
        if name.startswith("moe.experts"):
            assert torch.equal(g, by_groups[name]), name
            assert not torch.equal(left_alone[name], g), name
    # Expert parallelism: FastMoE leaves the sharded experts' summed gradient alone, fmoe divides by the world.
    groups = make_groups(world)
    sharded = lambda: ReplicatedExpertsModel(expert_dp_comm="none", world_size=world, group=groups.moe_group,  # noqa: E731
                                             num_expert=2)
    fastmoe = grads_after(sharded, DGDP, x)
    scaled = grads_after(sharded, lambda m: DGDP(m, groups=groups), x)
    for name, g in scaled.items():
        expected = fastmoe[name] / world if name.startswith("moe.experts") else fastmoe[name]
        torch.testing.assert_close(g, expected, atol=0, rtol=1e-6, msg=lambda m: f"{name}: {m}")


def check_dgdp_options(rank, world):
    """reduce_after, no_scale, fp32_allreduce and auto_allreduce against a hand-written reduction."""
    DGDP = fmoe.DistributedGroupedDataParallel
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(rank))
    raw = grads_after(ReplicatedExpertsModel, lambda m: DGDP(m, need_sync=False, dp_group=None), x, no_scale=True)
    local = grads_after(ReplicatedExpertsModel, lambda m: _NoSync(m), x)
    for name, g in raw.items():
        summed = local[name].clone()
        dist.all_reduce(summed)
        assert torch.equal(g, summed), f"no_scale {name}"
    after = grads_after(ReplicatedExpertsModel, lambda m: DGDP(m, need_sync=False), x, reduce_after=True)
    for name, g in after.items():
        torch.testing.assert_close(g, raw[name] / world, atol=0, rtol=1e-6)

    def auto(m):
        return DGDP(m, need_sync=False, auto_allreduce=True)
    torch.manual_seed(3)
    model = ReplicatedExpertsModel()
    wrapped = auto(model)
    (wrapped(x) ** 2).mean().backward()             # reduced by the hook at the end of the backward
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, raw[name] / world, atol=0, rtol=1e-6, msg=lambda m: f"auto {name}: {m}")

    half = lambda: ReplicatedExpertsModel().to(torch.bfloat16)  # noqa: E731
    xb = x.to(torch.bfloat16)
    fp32 = grads_after(half, lambda m: DGDP(m, need_sync=False), xb, fp32_allreduce=True)
    local = grads_after(half, lambda m: _NoSync(m), xb)
    for name, g in fp32.items():
        wide = local[name].float() / world
        dist.all_reduce(wide)
        assert g.dtype == local[name].dtype and torch.equal(g, wide.to(g.dtype)), f"fp32_allreduce {name}"
    assert any(g.dtype == torch.bfloat16 for g in fp32.values())


def check_dgdp_gradient_accumulation(rank, world, ep_size):
    """Two SGD steps of 4 micro-batches each equal one process on the global batch, in every mode:
    auto with no_sync on all but the last micro-batch, auto without it (a reduction after every
    backward, as torch's DDP), manual once after the last micro-batch and manual after each. Every
    gradient (expert and shared) of both steps, the second's after the first's update; no warning."""
    import contextlib
    import warnings
    micro, rows = 4, 3
    groups = make_groups(ep_size)
    e = 4 // ep_size
    ep_rank = rank % ep_size
    pairs = batches(2 * micro, rows * world)
    data = [pairs[:micro], pairs[micro:]]
    torch.manual_seed(1)
    full = TinyModel(4, 1)
    start = copy.deepcopy(full)
    whole = contextlib.nullcontext
    single = accumulate(full, full, data, 0, rows * world, world, lambda last: whole(), lambda: None, lambda: None)
    nothing = lambda: None  # noqa: E731
    for mode in ("auto_no_sync", "auto", "manual", "manual_each"):
        model = TinyModel(e, ep_size, groups.moe_group)
        copy_into_ep(start, model, ep_rank, e)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            wrapped = DistributedGroupedDataParallel(model, groups=groups, auto_allreduce=mode.startswith("auto"))
            context = (lambda last: whole() if last else wrapped.no_sync()) if mode == "auto_no_sync" \
                else (lambda last: whole())
            got = accumulate(wrapped, model, data, rank * rows, (rank + 1) * rows, 1, context,
                             wrapped.allreduce_params if mode == "manual_each" else nothing,
                             wrapped.allreduce_params if mode == "manual" else nothing)
        for step, (grads, ref) in enumerate(zip(got, single)):
            for name, p in model.named_parameters():
                expect = ref[name][ep_rank * e:(ep_rank + 1) * e] if getattr(p, "is_moe_expert", False) else ref[name]
                torch.testing.assert_close(grads[name], expect, atol=1e-6, rtol=1e-5,
                                           msg=lambda m: f"{mode} ep{ep_size} rank{rank} step{step} {name}: {m}")


def accumulate(step_model, model, data, lo, hi, chunks, micro_batch_context, after_backward, after_last):
    """SGD steps, each over its micro-batches (the loss of one: the mean of `chunks` per-chunk means
    over rows lo:hi, divided by the number of micro-batches); each step's gradients, before the update."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for step, micro_batches in enumerate(data):
        opt.zero_grad(set_to_none=step % 2 == 0)       # both ways of clearing a gradient
        for m, (x, y) in enumerate(micro_batches):
            with micro_batch_context(m == len(micro_batches) - 1):
                err = ((step_model(x[lo:hi]) - y[lo:hi]) ** 2).view(chunks, -1).mean(1).mean()
                (err / len(micro_batches)).backward()
            after_backward()
        after_last()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return grads


class _NoSync(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)

    def allreduce_params(self):
        pass


class TaggedModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1, self.linear2, self.linear3 = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def tag(self):
        for layer, tag in ((self.linear1, "mp"), (self.linear2, "dp"), (self.linear3, "world")):
            for p in layer.parameters():
                p.dp_comm = tag

    def forward(self, x):
        return self.linear3(torch.relu(self.linear2(torch.relu(self.linear1(x)))))


def check_dgdp_local_ddp(rank, world, mp_size):
    """Each tag reduced over its own group and averaged by its size (FastMoE's test_fmoe_local_ddp)."""
    mp_groups = [dist.new_group([j * mp_size + i for i in range(mp_size)]) for j in range(world // mp_size)]
    dp_groups = [dist.new_group([i * mp_size + j for i in range(world // mp_size)]) for j in range(mp_size)]
    mp_group, dp_group = mp_groups[rank // mp_size], dp_groups[rank % mp_size]
    torch.manual_seed(42 + rank)
    wrapped = fmoe.DistributedGroupedDataParallel(TaggedModule(), mp_group=mp_group, dp_group=dp_group,
                                                  world_group=None)
    reference = copy.deepcopy(wrapped.module)
    # need_sync broadcast every parameter (untagged: "dp") from the dp group's first rank.
    for p in reference.parameters():
        parts = [torch.empty_like(p) for _ in range(dist.get_world_size(dp_group))]
        dist.all_gather(parts, p.detach(), group=dp_group)
        assert all(torch.equal(parts[0], q) for q in parts), "need_sync left the dp replicas apart"
    wrapped.module.tag()
    x = torch.randn(4, D)
    wrapped(x).mean().backward()
    reference(x).mean().backward()
    wrapped.allreduce_params(reduce_after=False, fp32_allreduce=False)
    for layer, group in (("linear1", mp_group), ("linear2", dp_group), ("linear3", None)):
        for kind in ("weight", "bias"):
            ref = getattr(getattr(reference, layer), kind).grad.clone()
            dist.all_reduce(ref, group=group)
            ref /= dist.get_world_size(group)
            got = getattr(getattr(wrapped.module, layer), kind).grad
            torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6, msg=lambda m: f"{layer}.{kind}: {m}")


# --- Faults: stopped ranks, disagreeing ranks, ranks without tokens -----------------------------

def stop_rank_mid_training(rank, world, phase, result_file):
    """Rank 1 stops itself (SIGSTOP) at `phase`; rank 0 must fail within the collective timeout
    with a message naming the layer and the collective. Rank 0 writes what it saw to result_file."""
    import os
    import signal
    os.environ["FMOE_COLLECTIVE_TIMEOUT"] = "3"
    torch.manual_seed(0)
    model = ReplicatedExpertsModel(expert_dp_comm="none", world_size=world, num_expert=2)
    synced = fmoe.DistributedGroupedDataParallel(model)
    x = torch.randn(6, D)
    synced(x).sum().backward()                      # one good step: the check and every collective pass
    synced.allreduce_params()
    if rank == 1 and phase == "forward":
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        loss = synced(x).sum()
        if rank == 1 and phase == "backward":
            os.kill(os.getpid(), signal.SIGSTOP)
        loss.backward()
        if rank == 1 and phase == "allreduce":
            os.kill(os.getpid(), signal.SIGSTOP)
        synced.allreduce_params()
    except RuntimeError as err:
        with open(result_file, "w") as f:
            f.write(str(err))
        return
    raise AssertionError(f"rank {rank} went through a step with a stopped peer")


def check_disagreeing_ranks_raise(rank, world):
    """Ranks whose layers differ in a setting all raise the same clear error, in the check."""
    cases = [
        ("gate", dict(gate="naive" if rank == 0 else "balanced")),
        ("gate options", dict(gate="gshard", gate_kwargs={"capacity": (1.2, 2.4) if rank == 0 else None})),
        ("gate tensors", dict(gate_bias=rank == 0)),
        ("top_k", dict(top_k=1 + rank)),
        ("d_model", dict(d_model=D + 4 * rank)),
        ("expert tensors", dict(d_hidden=H + 4 * rank)),
        ("expert tensors", dict(dtype=torch.float32 if rank == 0 else torch.bfloat16)),
    ]
    for field, kw in cases:
        dtype = kw.pop("dtype", torch.float32)
        kw = {"d_model": D, "d_hidden": H, "top_k": 2, **kw}
        layer = fmoe.FMoETransformerMLP(num_expert=2, world_size=world, **kw).to(dtype)
        try:
            layer(torch.randn(4, kw["d_model"], dtype=dtype))
        except ValueError as err:
            message = str(err)
            assert "disagree" in message and field in message and "rank 0" in message and "rank 1" in message, \
                (field, message)
        else:
            raise AssertionError(f"ranks differing in {field} ({kw}) did not raise")


def check_zero_tokens_every_gate(rank, world, eval_gates, training_gates):
    """One rank without tokens, the other with some: every collective is reached by both, in
    evaluation (outputs equal one process) and in training (forward and backward complete)."""
    e = 2
    for gate, training in [(g, False) for g in eval_gates] + [(g, True) for g in training_gates]:
        torch.manual_seed(0)
        kw = {"capacity": None} if gate in ("gshard", "switch") else {}
        top_k = 1 if gate == "switch" else 2
        layer = fmoe.FMoETransformerMLP(num_expert=e, d_model=D, d_hidden=H, top_k=top_k,
                                        world_size=world, gate=gate, gate_kwargs=kw).train(training)
        for tokens in ([0, 6], [6, 0], [0, 0]):
            x = torch.randn(tokens[rank], D, requires_grad=True)
            y = layer(x)
            (y.sum() + (layer.aux_loss if layer.aux_loss is not None else 0)).backward()
            assert y.shape == x.shape and x.grad.shape == x.shape, (gate, tokens)
        if not training:
            full, ep = build_pair(gate, top_k, e, world, rank)
            x_all = torch.randn(5, D, generator=torch.Generator().manual_seed(1))
            lo, hi = (0, 0) if rank == 0 else (0, 5)
            torch.testing.assert_close(ep(x_all[lo:hi]), full(x_all)[lo:hi], atol=1e-5, rtol=1e-5)


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


def check_expert_parallel_keeps_received_rows_once(rank, world):
    """recompute="activation" across ranks: the floats kept are x (the gate's input), the gate's
    top-k scores, and of the rows this rank received (once) the rows, their pre-activation and
    their routing weights; nothing per sent slot (no T*K*D tensor on the sending side)."""
    from fmoe.observe.memory import saved_bytes
    e, top_k = 2, 2
    _, ep = build_pair("naive", top_k, e, world, rank, activation="swiglu")
    T = 6 + 3 * rank                     # unequal tokens: received and sent rows differ in number
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    saved = saved_bytes(ep, x)
    sent_E = ep.last_counts_E.clone()
    dist.all_reduce(sent_E)              # rows each expert received from all ranks
    R = int(sent_E[rank * e:(rank + 1) * e].sum())
    floats = sum(n for n, dtype, _ in saved.storages.values() if dtype.is_floating_point)
    assert floats == 4 * (T * D + T * top_k + R * (D + 2 * H + 1)), (floats, T, R)
    assert all(shape != (T * top_k, D) for _, dtype, shape in saved.storages.values())
