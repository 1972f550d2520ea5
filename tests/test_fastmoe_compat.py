"""FastMoE compatibility: import paths, FMoE's FastMoE behaviours, FastMoE state dicts, the
FastMoE-only gates (Zero, DC, SWIPE), the routing helpers and the Megatron-LM helpers."""
import argparse
import importlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fmoe import FMoE, FMoETransformerMLP
from fmoe.gates import NaiveGate
from fmoe.transformer import _Expert
from tests.dist_utils import run_ranks
from tests.reference import per_token_moe

FASTMOE_PATHS = {
    "fmoe": ["FMoE", "FMoELinear", "FMoETransformerMLP", "DistributedGroupedDataParallel"],
    "fmoe.layers": ["FMoE", "_fmoe_general_global_forward", "mark_module_parallel_comm"],
    "fmoe.linear": ["FMoELinear", "MOELinear"],
    "fmoe.transformer": ["_Expert", "FMoETransformerMLP"],
    "fmoe.functions": ["ensure_comm", "count_by_gate", "prepare_forward", "MOEScatter", "MOEGather",
                       "AllGather", "Slice"],
    "fmoe.distributed": ["DistributedGroupedDataParallel"],
    "fmoe.balance": ["reset_balance_profile", "update_balance_profile", "metrics"],
    "fmoe.utils": ["get_torch_default_comm", "get_rank_0_in_comm"],
    "fmoe.gates": ["ZeroGate", "NaiveGate", "NoisyGate", "GShardGate", "SwitchGate", "DCGate", "SwipeGate"],
    "fmoe.gates.base_gate": ["BaseGate"], "fmoe.gates.naive_gate": ["NaiveGate"],
    "fmoe.gates.noisy_gate": ["NoisyGate"], "fmoe.gates.gshard_gate": ["GShardGate"],
    "fmoe.gates.switch_gate": ["SwitchGate"], "fmoe.gates.zero_gate": ["ZeroGate"],
    "fmoe.gates.dc_gate": ["DCGate"], "fmoe.gates.swipe_gate": ["SwipeGate"],
    "fmoe.gates.faster_gate": ["FasterGate"], "fmoe.gates.utils": ["limit_by_capacity", "prune_gate_by_capacity"],
    "fmoe.fastermoe.config": ["switch_from_env", "float_from_env"],
    "fmoe.fastermoe.schedule": ["_fmoe_general_global_forward"],
    "fmoe.megatron": ["fmoefy", "MegatronMLP", "add_fmoe_args", "save_checkpoint", "load_checkpoint",
                      "DistributedDataParallel", "reset_gate_hook", "get_balance_profile",
                      "generate_megatron_gate_hook", "add_balance_log", "patch_forward_step", "patch_model_provider"],
    "fmoe.megatron.layers": ["_megatron_init_method", "_random_init_weight", "fmoefy", "MegatronMLP"],
    "fmoe.megatron.checkpoint": ["save_checkpoint", "load_checkpoint"],
}


@pytest.mark.parametrize("module", sorted(FASTMOE_PATHS))
def test_fastmoe_import_paths(module):
    mod = importlib.import_module(module)
    for name in FASTMOE_PATHS[module]:
        assert hasattr(mod, name), f"{module}.{name}"


class Lin(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x):
        return self.linear(x)


class CountingLin(Lin):
    """A FastMoE-style expert: forward(inp, fwd_expert_count) and checks the count it is given."""

    def forward(self, inp, fwd_expert_count):
        assert int(fwd_expert_count.sum()) == inp.shape[0]
        return self.linear(inp) * 2


def assert_close_all(a, b, tol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=tol, rtol=tol, msg=k)


def test_expert_list_without_num_expert_indexable_and_with_count():
    torch.manual_seed(0)
    moe = FMoE(num_expert=None, d_model=8, expert=[Lin, CountingLin, Lin], top_k=2)
    assert moe.num_expert == 3 and isinstance(moe.experts[1], CountingLin) and len(list(moe.experts)) == 3
    assert "experts.1.linear.weight" in moe.state_dict()          # FastMoE's keys
    x = torch.randn(10, 8)
    ref, _ = per_token_moe(moe, x)
    torch.testing.assert_close(moe(x), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="num_expert=2"):
        FMoE(num_expert=2, d_model=8, expert=[Lin, Lin, Lin])


class FusedMoE(FMoE):
    """FastMoE's fused pattern: FMoE without experts, then self.experts assigned."""

    def __init__(self, num_expert=4, d_model=8, d_hidden=16, top_k=2):
        super().__init__(num_expert=num_expert, d_model=d_model, gate=NaiveGate, top_k=top_k)
        self.experts = _Expert(num_expert, d_model, d_hidden, F.gelu)


def brute_force(moe, x):
    """Per slot: GELU MLP of FastMoE's [e, out, in] weights, weighted by the gate's FastMoE tuple."""
    idx, val = moe.gate(x)
    e1, e2 = moe.experts.htoh4, moe.experts.h4toh
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            h = F.gelu(x[t] @ e1.weight[e].t() + e1.bias[e])
            out[t] = out[t] + val[t, k] * (h @ e2.weight[e].t() + e2.bias[e])
    return out


def test_fused_subclass_pattern_and_init():
    torch.manual_seed(0)
    moe = FusedMoE()
    from fmoe.megatron.layers import _megatron_init_method
    _megatron_init_method(moe.experts.htoh4, np.random.default_rng(1), 1.0)
    assert moe.experts.htoh4.weight.dp_comm == "none" and moe.experts.htoh4.weight.is_moe_expert
    assert float(moe.experts.htoh4.bias.abs().sum()) == 0
    x = torch.randn(6, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, ref = moe(x), brute_force(moe, x2)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(y)
    gw = torch.autograd.grad((y * w).sum(), [x] + list(moe.parameters()))
    gr = torch.autograd.grad((ref * w).sum(), [x2] + list(moe.parameters()))
    for a, b in zip(gw, gr):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="assign self.experts"):
        FMoE(num_expert=2, d_model=8)(torch.randn(2, 8))


def test_overridden_expert_fn_is_called():
    calls = []

    class Traced(FusedMoE):
        def expert_fn(self, inp, fwd_expert_count):
            calls.append(fwd_expert_count.clone())
            return super().expert_fn(inp, fwd_expert_count) * 0

    out = Traced()(torch.randn(5, 8))
    assert len(calls) == 1 and int(calls[0].sum()) == 10 and float(out.abs().sum()) == 0


def test_mark_parallel_comm():
    moe = FMoETransformerMLP(num_expert=2, d_model=8, d_hidden=16, expert_dp_comm="dp")
    assert {p.dp_comm for p in moe.experts.parameters()} == {"dp"}
    assert {p.dp_comm for p in moe.gate.parameters()} == {"gate"}
    moe.mark_parallel_comm("none")
    assert {p.dp_comm for p in moe.experts.parameters()} == {"none"}


def test_mask_and_mask_dict():
    torch.manual_seed(0)
    mask = torch.tensor([0, 1, 0, 2, 0, 0])
    mask_dict = {1: torch.full((8,), 3.0), 2: torch.full((8,), -1.0)}
    moe = FMoE(num_expert=4, d_model=8, d_hidden=16, mask=mask, mask_dict=mask_dict)
    plain = FMoE(num_expert=4, d_model=8, d_hidden=16)
    plain.load_state_dict(moe.state_dict())
    x = torch.randn(6, 8)
    y, y_plain = moe(x), plain(x)
    torch.testing.assert_close(y[mask == 0], y_plain[mask == 0])
    torch.testing.assert_close(y[1], mask_dict[1])                  # NaiveGate's weights sum to 1
    torch.testing.assert_close(y[3], mask_dict[2])
    assert int(moe.last_counts_E.sum()) == 4 * 2                   # masked tokens reach no expert
    with pytest.raises(ValueError, match="mask and mask_dict"):
        FMoE(num_expert=2, d_model=8, d_hidden=8, mask=mask)


class DictExperts(nn.Module):
    """Multi-input experts (FastMoE's test_mimo): one expert MLP applied to both tensors."""

    def __init__(self, e, d, h):
        super().__init__()
        self.inner = _Expert(e, d, h, F.relu)

    def forward(self, inp, fwd_expert_count):
        return {k: self.inner(v, fwd_expert_count) for k, v in inp.items()}


class DictGate(NaiveGate):
    def forward(self, inp, return_all_scores=False):
        return super().forward(inp["x"], return_all_scores)


@pytest.mark.parametrize("tree", [lambda x: (x, x), lambda x: {"x": x, "y": x}])
@pytest.mark.parametrize("gate", ["naive", "router", NaiveGate])
def test_a_tree_input_to_a_built_in_gate_is_refused_by_name(tree, gate):
    moe = FMoETransformerMLP(num_expert=2, d_model=8, d_hidden=16, gate=gate)
    with pytest.raises(TypeError, match="input is a (tuple|dict).* a tree input needs a gate that takes the tree"):
        moe(tree(torch.randn(3, 8)))


def test_nested_inputs():
    torch.manual_seed(0)
    moe = FMoE(num_expert=4, d_model=8, gate=DictGate, top_k=2)
    moe.experts = DictExperts(4, 8, 16)
    single = FMoE(num_expert=4, d_model=8, gate=NaiveGate, top_k=2)
    single.experts = moe.experts.inner
    single.gate.load_state_dict(moe.gate.state_dict())
    x, z = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    out = moe({"x": x, "y": z})
    assert set(out) == {"x", "y"} and out["x"].shape == (3, 2, 8)
    torch.testing.assert_close(out["x"], single(x))
    idx, val = single.gate(x.reshape(-1, 8))
    expected_y = torch.zeros(6, 8)          # y follows x's routing
    y_rows = z.reshape(-1, 8)
    e = moe.experts.inner
    for t in range(6):
        for k in range(2):
            j = int(idx[t, k])
            h = F.relu(y_rows[t] @ e.htoh4.weight[j].t() + e.htoh4.bias[j])
            expected_y[t] += val[t, k] * (h @ e.h4toh.weight[j].t() + e.h4toh.bias[j])
    torch.testing.assert_close(out["y"].reshape(-1, 8), expected_y, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="leading dims"):
        moe({"x": x, "y": torch.randn(4, 8)})


class ConstantGate(nn.Module):
    """A gate that is no BaseGate at all, as FastMoE's test_zero writes one."""

    def __init__(self, d_model, num_expert, world_size, top_k=1):
        super().__init__()
        self.top_k = top_k

    def forward(self, inp):
        idx = torch.zeros((inp.shape[0], self.top_k), dtype=torch.int64)
        return idx, torch.full((inp.shape[0], 1, self.top_k), 0.5)


def test_plain_module_gate_and_zero_gate():
    from fmoe.gates import ZeroGate
    x = torch.randn(4, 8)
    for gate in (ConstantGate, ZeroGate):
        moe = FMoETransformerMLP(num_expert=2, d_model=8, d_hidden=16, gate=gate, top_k=2)
        y = moe(x)
        assert moe.last_counts_E.tolist() == [8, 0]
        e = moe.experts
        y0 = e.expert_forward(0, x)
        torch.testing.assert_close(y, y0, atol=1e-5, rtol=1e-5)     # two slots of weight 1/2 on expert 0


def fastmoe_transformer_state(num_expert, d_model, d_hidden, seed):
    """The state dict FastMoE's FMoETransformerMLP saves: one _Expert(1, ...) per expert and the
    router at gate.gate, built from fmoe pieces with FastMoE's structure."""
    torch.manual_seed(seed)
    layer = FMoE(num_expert=num_expert, d_model=d_model,
                 expert=lambda d: _Expert(1, d, d_hidden, nn.GELU()), top_k=2)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.3)
    state = layer.state_dict()
    state["gate.gate.weight"] = state.pop("gate.gate.proj.weight")
    state["gate.gate.bias"] = state.pop("gate.gate.proj.bias")
    return layer, state


def test_fastmoe_checkpoint_loads_with_equal_outputs():
    fastmoe_like, state = fastmoe_transformer_state(4, 8, 16, seed=3)
    assert "experts.3.htoh4.weight" in state and state["experts.3.htoh4.weight"].shape == (1, 16, 8)
    moe = FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=16, activation=nn.GELU(), top_k=2)
    moe.load_state_dict(state)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(moe(x), fastmoe_like(x.reshape(-1, 8)).reshape(2, 5, 8), atol=1e-5, rtol=1e-5)
    del state["experts.2.h4toh.bias"]
    with pytest.raises(KeyError, match="lack h4toh.bias"):
        FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=16).load_state_dict(state)


class CustomizedMoEPositionwiseFF(FMoETransformerMLP):
    """Transformer-XL's pattern (FastMoE examples/transformer-xl): an activation module with
    dropout, a residual and a layer norm around the MoE."""

    def __init__(self, d_model, d_inner, dropout, moe_num_expert=4, moe_top_k=2):
        super().__init__(num_expert=moe_num_expert, d_model=d_model, d_hidden=d_inner, top_k=moe_top_k,
                         activation=nn.Sequential(nn.ReLU(), nn.Dropout(dropout)))
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, inp):
        return self.layer_norm(inp + super().forward(inp))


def test_transformer_xl_pattern_init_reaches_experts_and_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), CustomizedMoEPositionwiseFF(8, 16, 0.1), nn.Linear(8, 16))

    def weights_init(m):        # Transformer-XL's: every module whose class name has "Linear"
        if m.__class__.__name__.find("Linear") != -1:
            if getattr(m, "weight", None) is not None:
                nn.init.normal_(m.weight, 0.0, 0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.constant_(m.bias, 0.0)

    model.apply(weights_init)
    experts = model[1].experts
    assert experts.w1_eDF.std() < 0.03 and float(experts.b2_eD.abs().sum()) == 0
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.randint(0, 16, (32,))
    losses = []
    for _ in range(15):
        loss = F.cross_entropy(model(data), data)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_routing_helpers_single_process():
    from fmoe.functions import MOEGather, MOEScatter, count_by_gate, prepare_forward
    from fmoe.layers import _fmoe_general_global_forward
    from fmoe.fastermoe.schedule import _fmoe_general_global_forward as smart_fwd
    gate = torch.tensor([[2, 0], [1, 2], [2, -1]])
    pos, lec, gec = count_by_gate(gate, 3, 1)
    assert lec.tolist() == [1, 1, 3] and gec.tolist() == [1, 1, 3]
    assert pos.tolist() == [1, 2, 0, 3, 4]      # slots in expert order, token order within an expert
    pos, lec, gec, fec, fbs = prepare_forward(gate, 3, 1)
    assert fec.tolist() == [1, 1, 3] and fbs == 5
    x = torch.randn(3, 4, requires_grad=True)
    rows = MOEScatter.apply(x, torch.div(pos, 2, rounding_mode="floor"), lec, gec, fbs, 1)
    torch.testing.assert_close(rows, x[[0, 1, 0, 1, 2]])
    back = MOEGather.apply(rows * 2, pos, lec, gec, 6, 1)
    torch.testing.assert_close(back.view(3, 2, 4)[2, 1], torch.zeros(4))
    torch.testing.assert_close(back.view(3, 2, 4)[:, 0], 2 * x)
    scales = torch.tensor([1.0, 2.0, 3.0])

    def ef(rows, fec):
        return rows * torch.repeat_interleave(scales, fec)[:, None]

    y = _fmoe_general_global_forward(x, gate, ef, 3, 1).view(3, 2, 4)
    torch.testing.assert_close(y[1, 1], 3 * x[1])
    y2 = smart_fwd(x, gate, lambda r, c, e: r * scales[e], 3, 1)
    torch.testing.assert_close(y2.view(3, 2, 4), y)


def test_dc_gate_capacity_single_process():
    from fmoe.gates import DCGate
    torch.manual_seed(0)
    gate = DCGate(8, 2, 1, capacity=(0.5, 0.5), random_routing=False)
    routing = gate.routing(torch.randn(20, 8))
    counts = torch.bincount(routing.expert_idx_TK[routing.expert_idx_TK >= 0], minlength=2)
    assert counts.max() <= 10 and int(routing.num_dropped) == 40 - int(counts.sum()) > 0


def test_swipe_plan_hand_example():
    from fmoe.gates.swipe import swipe_plan
    sent = torch.tensor([[3, 1], [4, 0]])     # rank 0 sends 3 to itself, 1 to rank 1; rank 1 sends 4 to rank 0
    final, left = swipe_plan(sent, torch.tensor([4, 4]))
    # rank 0 accepts 3 from itself and 1 of rank 1's 4; rank 1's 3 refused slots go to rank 1
    assert final.tolist() == [[3, 1], [1, 3]] and left.tolist() == [0, 0]
    with pytest.raises(ValueError, match="capacity is too small"):
        swipe_plan(sent, torch.tensor([2, 2]))


def check_swipe(rank, world):
    from fmoe.gates import SwipeGate
    torch.manual_seed(rank)
    gate = SwipeGate(8, 2, world).train()
    idx_T = torch.full((6,), 0) if rank == 0 else torch.tensor([0, 0, 0, 3, 3, 1])
    new_T, left = gate.swipe_once(idx_T, torch.tensor(6), bias=1)
    everyone = [torch.empty_like(new_T) for _ in range(world)]
    dist.all_gather(everyone, new_T)
    received_W = torch.bincount(torch.cat(everyone) // 2, minlength=world)
    assert received_W.tolist() == [6, 6]           # each rank took exactly its capacity
    if rank == 0:                                  # rank 0's own slots come first at rank 0: all kept
        assert new_T.tolist() == [0] * 6 and int(left) == 0
    else:                                          # its 4 slots to rank 0 were refused and moved home
        assert new_T.tolist() == [3, 3, 3, 3, 3, 3] and int(left) == 0
    x = torch.randn(5, 8)
    idx, val = gate(x)
    assert idx.shape == (5, 2) and bool((idx >= 0).all())
    torch.testing.assert_close(val.sum(-1), torch.ones(5))


def test_swipe_gate_two_ranks():
    run_ranks(check_swipe, 2)


def check_slice_group(rank, world):
    torch.manual_seed(0)        # same layer and input on both ranks of the slice group
    moe = FMoE(num_expert=4, d_model=8, d_hidden=16, slice_group=dist.new_group([0, 1]))
    ref = FMoE(num_expert=4, d_model=8, d_hidden=16)
    ref.load_state_dict(moe.state_dict())
    x = torch.randn(6, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = moe(x), ref(x_ref)
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-6)
    assert int(moe.last_counts_E.sum()) == 6      # this rank routed its 3 tokens only
    w = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    (y * w).sum().backward()
    (y_ref * w).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-6, rtol=1e-6)
    for (n, p), q in zip(moe.named_parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)                         # each rank holds its slice's share
        torch.testing.assert_close(g, q.grad, atol=1e-5, rtol=1e-5, msg=n)


def test_slice_group_two_ranks():
    run_ranks(check_slice_group, 2)


def test_megatron_helpers():
    from fmoe.megatron import add_fmoe_args, get_balance_profile, patch_forward_step, reset_gate_hook
    from fmoe.megatron import generate_megatron_gate_hook, save_checkpoint
    args = add_fmoe_args(argparse.ArgumentParser()).parse_args(["--fmoefy", "--num-experts", "4", "--top-k", "1"])
    assert args.fmoefy and args.num_experts == 4 and args.top_k == 1
    with pytest.raises(NotImplementedError, match="MegatronMLP adds it itself"):
        patch_forward_step(lambda *a: None)
    with pytest.raises(NotImplementedError, match="dist_checkpointing"):
        save_checkpoint(0, None, None, None)
    reset_gate_hook(2, balance_strategy="gshard")
    moe = FMoE(num_expert=4, d_model=8, d_hidden=8, gate_hook=generate_megatron_gate_hook(1, 4))
    moe(torch.randn(16, 8))
    profile = get_balance_profile()
    assert profile["Lmax-over-Lmean"][0] is None and profile["Lmax-over-Lmean"][1] >= 1
    assert "gshard_loss" in profile


def test_sharded_checkpoint_of_user_experts(tmp_path):
    from fmoe.distributed.checkpoint import load_checkpoint, save_checkpoint
    torch.manual_seed(0)
    moe = FMoE(num_expert=3, d_model=8, expert=Lin)
    save_checkpoint(str(tmp_path / "ck"), moe)
    other = FMoE(num_expert=3, d_model=8, expert=Lin)
    load_checkpoint(str(tmp_path / "ck"), other)
    for (n, p), q in zip(moe.state_dict().items(), other.state_dict().values()):
        torch.testing.assert_close(p, q, msg=n)
