"""Rank bodies for the HF families' multi-process tests (run by tests.dist_utils.run_ranks): the seam sweep at
ep_size=2 (every family in one pair of processes, each outcome written by rank 0 to a JSON file), the seam's
save / export / resume, and experts_implementation="fmoe" under transformers' own expert parallelism."""
import json
import traceback

import torch
import torch.distributed as dist

import fmoe.integrations.hf
from fmoe.integrations.hf.seam import SeamMoE
from tests.hf_families import assert_close_fp32, forward_backward, tiny, tokens


def sweep_ep(rank, world_size, names, path):
    """check_family_ep for each family; rank 0 writes {family: "ok" or the error} to `path`."""
    torch.set_num_threads(1)
    results = {}
    for name in names:
        try:
            check_family_ep(rank, world_size, name)
            outcome = "ok"
        except Exception as err:     # noqa: BLE001 - recorded per family; the ranks fail alike
            outcome = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}"
        outcomes = [None] * world_size
        dist.all_gather_object(outcomes, outcome)
        results[name] = next((o for o in outcomes if o != "ok"), "ok")
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f)


def check_family_ep(rank, world_size, name):
    """Both ranks feed the same batch to the family converted at the seam with ep_size=world_size: the
    output equals one process; every gradient outside the experts equals one process's; each expert
    tensor's gradient is world_size times its slice of one process's (both ranks' tokens reach it); a
    replicated tensor of the experts module (a post-expert norm) sums over the ranks to world_size times."""
    model = tiny(name)
    ids = tokens()
    want_y, want = forward_backward(model, ids)
    converted = fmoe.integrations.hf.convert(model, ep_size=world_size, seam=True)
    layers = {n: m for n, m in converted.named_modules() if isinstance(m, SeamMoE)}
    assert layers and all(m.world_size == world_size for m in layers.values())
    got_y, got = forward_backward(converted, ids)
    assert_close_fp32(got_y, want_y, f"{name} at ep_size={world_size}: output")
    sliced = {f"{n}.{t}": m for n, m in layers.items() for t in m.experts._parameters
              if t in ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")}
    replicated = {f"{n}.{t}" for n, m in layers.items() for t, _ in m.experts.named_parameters()} - set(sliced)
    assert set(got) == set(want), f"{name}: gradients differ in names: {sorted(set(got) ^ set(want))}"
    for key, grad in want.items():
        if key in sliced:
            e = sliced[key].num_expert
            grad = world_size * grad[rank * e:(rank + 1) * e]
            assert_close_fp32(got[key], grad, f"{name}: grad {key} (this rank's experts)")
        elif key in replicated:
            total = got[key].clone()
            dist.all_reduce(total)
            assert_close_fp32(total, world_size * grad, f"{name}: grad {key} summed over the ranks")
        else:
            assert_close_fp32(got[key], grad, f"{name}: grad {key}")
    stats = [m.routing_stats for m in layers.values()]
    assert all(s for s in stats), f"{name}: a seam layer left no routing statistics"


def step(model, ids):
    """One Adam step on the projected output (the optimizer then holds state for every parameter)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    forward_backward(model, ids)
    optimizer.step()
    return optimizer


def tensors_of(model, optimizer):
    """The checkpoint's flat entries (experts by global id) that are tensors, detached copies."""
    from fmoe.distributed.checkpoint import checkpoint_state
    return {k: v.detach().clone() for k, v in checkpoint_state(model, optimizer).items()
            if isinstance(v, torch.Tensor)}


def save_and_resume(rank, world_size, names, folder):
    """For each family, at ep_size=world_size: (1) `save_pretrained` and `export` of the freshly converted
    model into `<folder>/<name>/hf` and `.../export` (the experts gathered; rank 0 writes); (2) one Adam
    step, then a sharded checkpoint into `<folder>/<name>/ep2` and the checkpoint's entries of every rank into
    `<folder>/<name>/ep2-<rank>.pt`; (3) a model converted from another seed resumed from the
    one-process checkpoint `<folder>/<name>/ep1`, its entries checked against `<folder>/<name>/ep1.pt`."""
    from fmoe.distributed.checkpoint import load_checkpoint, save_checkpoint
    from fmoe.integrations.hf.seam import SeamMoE
    torch.set_num_threads(1)
    for name in names:
        base = f"{folder}/{name}"
        model = fmoe.integrations.hf.convert(tiny(name), ep_size=world_size, seam=True)
        model.save_pretrained(f"{base}/hf")
        fmoe.integrations.hf.export(model, f"{base}/export")
        optimizer = step(model, tokens())
        save_checkpoint(f"{base}/ep2", model, optimizer)
        torch.save(tensors_of(model, optimizer), f"{base}/ep2-{rank}.pt")
        resumed = fmoe.integrations.hf.convert(tiny_from_seed(name, 7), ep_size=world_size, seam=True)
        assert all(m.world_size == world_size for m in resumed.modules() if isinstance(m, SeamMoE))
        resumed_optimizer = torch.optim.Adam(resumed.parameters(), lr=1e-2)
        load_checkpoint(f"{base}/ep1", resumed, resumed_optimizer)
        want = torch.load(f"{base}/ep1.pt")
        got = tensors_of(resumed, resumed_optimizer)
        lacking = sorted(set(got) - set(want))
        assert not lacking, f"{name}: entries the one-process checkpoint lacks: {lacking}"
        for key, value in got.items():
            assert torch.equal(value, want[key]), f"{name}: {key} resumed at ep_size={world_size} differs"


def tiny_from_seed(name, seed):
    from tests.hf_families import families
    return families()[name].build(seed=seed)


def transformers_ep(rank, world_size, folder, implementation, out):
    """The checkpoint in `folder` loaded by transformers with its own expert parallelism
    (DistributedConfig(tp_size=2, ep_size=2): each rank holds half the experts, the dense layers split by the
    family's tensor plan) and `experts_implementation`; rank 0 writes the no-grad output (transformers'
    all-reduce EP), the output with grad and every full gradient (its all-to-all EP) and the number of calls
    of fmoe's experts forward to `out`."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.integrations.moe import ExpertsInterface

    from fmoe.integrations.hf.experts_impl import NAME, fmoe_experts_forward
    from tests.hf_families import output
    torch.set_num_threads(1)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return fmoe_experts_forward(*args, **kwargs)

    ExpertsInterface.register(NAME, counted)         # looked up at each call
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, experts_implementation=implementation,
                                                     distributed_config=DistributedConfig(tp_size=2, ep_size=2))
        model.eval()
        ids = tokens()
        with torch.no_grad():
            inference = output(model, ids)
        y, grads = forward_backward(model, ids)
    finally:
        ExpertsInterface.register(NAME, fmoe_experts_forward)
    grads = {k: g.full_tensor() if hasattr(g, "full_tensor") else g for k, g in grads.items()}
    if rank == 0:
        torch.save({"inference": inference, "y": y, "grads": grads, "calls": len(calls)}, out)
