"""Rank bodies for the seam sweep at ep_size=2 (run by tests.dist_utils.run_ranks): every family in one pair
of processes, each family's outcome written by rank 0 to a JSON file for the tests to read."""
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
