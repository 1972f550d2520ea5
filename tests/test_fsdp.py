"""FSDP2 + expert parallelism (fmoe.distributed.fsdp) on real gloo ranks against one process.

A small model (dense layer, an activation-checkpointed MoE layer, dense head) trains two SGD steps
at EP 2 on 2 ranks and at EP 2 x DP 2 on 4; its parameters must equal the single-process model's
trained on the global batch. The 4-rank run saves a DCP checkpoint, which one plain process loads
(EP 1) and a sharded 2-rank run loads (EP 2), both equal to the single-process model and optimizer.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import fmoe
from tests.dist_utils import run_ranks

D, H, EXPERTS, ROWS, STEPS = 8, 16, 4, 4, 2


class Net(nn.Module):
    def __init__(self, ep_size=1, moe_group=None):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = fmoe.FMoETransformerMLP(num_expert=EXPERTS // ep_size, d_model=D, d_hidden=H, top_k=2,
                                           world_size=ep_size, moe_group=moe_group, gate="gshard",
                                           gate_kwargs={"capacity": None, "random_routing": False})
        self.out = nn.Linear(D, 1)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        return self.out(h + checkpoint(self.moe, h, use_reentrant=False))


def reference():
    """The single-process model, its data and its SGD optimizer after STEPS steps on the global batch."""
    torch.manual_seed(1)
    model = Net()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(4 * ROWS, D, generator=g), torch.randn(4 * ROWS, 1, generator=g)) for _ in range(STEPS)]
    return model, init, data


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(model, opt, data, first_share, shares):
    """MSE over `shares` shares of ROWS rows from `first_share` on, averaged per share: a rank trains on
    its own share, the one process on every rank's."""
    for x, y in data:
        opt.zero_grad()
        rows = slice(first_share * ROWS, (first_share + shares) * ROWS)
        err = (model(x[rows]) - y[rows]) ** 2
        err.view(shares, -1).mean(1).mean().backward()
        opt.step()


def expert_rows(name, p, ep_rank, ep_size):
    e = EXPERTS // ep_size
    return p[ep_rank * e:(ep_rank + 1) * e] if name.startswith("moe.experts.") else p


def assert_matches(model, opt, ref, ref_opt, ep_rank, ep_size, what):
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        for key, mine, theirs in (("param", p, ref_params[name]),
                                  ("momentum", opt.state[p]["momentum_buffer"],
                                   ref_opt.state[ref_params[name]]["momentum_buffer"])):
            mine = mine.full_tensor() if hasattr(mine, "full_tensor") else mine
            torch.testing.assert_close(mine.detach(), expert_rows(name, theirs, ep_rank, ep_size).detach(),
                                       atol=1e-5, rtol=1e-5, msg=lambda m: f"{what} {name} {key}: {m}")


def sharded_net(ep_size):
    from fmoe.distributed.groups import make_groups

    groups = make_groups(ep_size)
    model = Net(ep_size, groups.moe_group)
    ep_rank = dist.get_rank() % ep_size
    return model, groups, ep_rank


def train_sharded(rank, world, ep_size, ckpt):
    from fmoe.distributed.fsdp import save_checkpoint, shard_model

    ref, init, data = reference()
    model, groups, ep_rank = sharded_net(ep_size)
    model.load_state_dict({k: expert_rows(k, v, ep_rank, ep_size) for k, v in init.items()})
    shard_model(model, groups)
    opt = sgd(model)
    train(model, opt, data, rank, 1)
    ref_opt = sgd(ref)
    train(ref, ref_opt, data, 0, world)
    assert_matches(model, opt, ref, ref_opt, ep_rank, ep_size, f"EP {ep_size} on {world} ranks")
    if ckpt:
        save_checkpoint(ckpt, model, opt)


def load_sharded(rank, world, ep_size, ckpt):
    from fmoe.distributed.fsdp import load_checkpoint, shard_model

    ref, _, data = reference()
    ref_opt = sgd(ref)
    train(ref, ref_opt, data, 0, 4)
    model, groups, ep_rank = sharded_net(ep_size)
    shard_model(model, groups)
    opt = sgd(model)
    load_checkpoint(ckpt, model, opt)
    assert_matches(model, opt, ref, ref_opt, ep_rank, ep_size, f"loaded at EP {ep_size} on {world} ranks")


@pytest.mark.parametrize("world,ep_size", [(2, 2), (4, 2)])
def test_fsdp_with_expert_parallelism_trains_like_one_process(world, ep_size, tmp_path):
    run_ranks(train_sharded, world, ep_size, None)


def test_fsdp_checkpoint_reshards(tmp_path):
    from fmoe.distributed.checkpoint import load_checkpoint

    ckpt = str(tmp_path / "ckpt")
    run_ranks(train_sharded, 4, 2, ckpt)
    ref, _, data = reference()
    ref_opt = sgd(ref)
    train(ref, ref_opt, data, 0, 4)
    plain, _, _ = reference()
    plain_opt = sgd(plain)
    train(plain, plain_opt, data[:1], 0, 4)        # creates the momentum buffers, then overwritten
    load_checkpoint(ckpt, plain, plain_opt)
    assert_matches(plain, plain_opt, ref, ref_opt, 0, 1, "loaded in one process")
    run_ranks(load_sharded, 2, 2, ckpt)


def test_shard_model_refuses_mismatched_groups():
    run_ranks(refuse_mismatch, 2)


def refuse_mismatch(rank, world):
    from fmoe.distributed.fsdp import shard_model
    from fmoe.distributed.groups import make_groups

    groups = make_groups(1)
    model = Net(2, dist.group.WORLD)
    with pytest.raises(ValueError, match="world_size=2, groups.ep_size is 1"):
        shard_model(model, groups)


def test_layer_returns_a_fresh_tensor():
    layer = fmoe.FMoETransformerMLP(num_expert=2, d_model=D, d_hidden=H)
    y = layer(torch.randn(2, 3, D))
    assert y._base is None and y.shape == (2, 3, D)
