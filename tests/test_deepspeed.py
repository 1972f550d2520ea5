"""fmoe layers under DeepSpeed ZeRO 0/1/2 on 2 processes (gloo), against plain fmoe training."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import fmoe  # noqa: E402
import fmoe.integrations.deepspeed as fds  # noqa: E402
from fmoe.distributed.ddp import DistributedGroupedDataParallel  # noqa: E402
from fmoe.distributed.groups import ParallelGroups  # noqa: E402
from tests.dist_utils import exit_without_teardown, free_port, init_gloo_from_env  # noqa: E402

# The DeepSpeed runs (its engine, ZeRO, the launcher) run with FMOE_TEST_DEEPSPEED=1: `make test-deepspeed`,
# in CI (out of `make test`, which keeps its time budget).
pytestmark = pytest.mark.skipif(os.environ.get("FMOE_TEST_DEEPSPEED") != "1",
                                reason="The DeepSpeed runs (its engine, ZeRO, the launcher): FMOE_TEST_DEEPSPEED=1 "
                                       "(make test-deepspeed)")

VOCAB, D, H, T, BATCH, STEPS, LR = 32, 16, 32, 8, 4, 6, 3e-2


class TinyLM(nn.Module):
    """Embedding -> residual MoE FFN -> LayerNorm -> head; learns token -> (3 * token + 1) mod VOCAB."""

    def __init__(self, groups):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.moe = fmoe.FMoETransformerMLP(num_expert=2, d_model=D, d_hidden=H, top_k=2, gate="gshard",
                                           gate_kwargs={"capacity": None}, world_size=groups.ep_size,
                                           moe_group=groups.moe_group)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x_BT, y_BT):
        h = self.emb(x_BT)
        h = h + self.moe(h)
        loss = F.cross_entropy(self.head(self.norm(h)).flatten(0, 1), y_BT.flatten())
        return loss + 0.01 * fmoe.collect_aux_loss(self)


def batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = torch.randint(VOCAB, (BATCH, T), generator=g)
        yield x, (3 * x + 1) % VOCAB


def ds_config(stage):
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10 ** 6,
    }


def build(groups):
    torch.manual_seed(0)
    return TinyLM(groups)


def train_deepspeed(rank, groups, stage):
    model = build(groups)
    fds.mark_expert_params(model)
    params = fds.moe_param_groups(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params,
                                      optimizer=torch.optim.Adam(params, lr=LR), config=ds_config(stage))
    assert engine.has_moe_layers
    losses = []
    for x, y in batches(rank):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


def train_plain_fmoe(rank, groups):
    model = DistributedGroupedDataParallel(build(groups), groups=groups)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for x, y in batches(rank):
        opt.zero_grad()
        model(x, y).backward()
        model.allreduce_params()
        opt.step()
    return model.module


def check_zero_optimizer_groups(engine, groups):
    """ZeRO partitions each expert group over the expert-data-parallel ranks, the rest over all."""
    zero = engine.optimizer
    for i, group in enumerate(zero.optimizer.param_groups):
        expected = groups.dp_size if group.get("moe") else dist.get_world_size()
        assert all(getattr(p, "allreduce", True) is not group.get("moe", False) for p in zero.bit16_groups[i])
        assert dist.get_world_size(zero.real_dp_process_group[i]) == expected, group["name"]


def check_stage(rank, world, stage, ep_size):
    groups = fds.setup_expert_parallel(ep_size)
    engine, losses = train_deepspeed(rank, groups, stage)
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.2, f"stage {stage} rank {rank}: loss did not fall: {losses}"
    if stage > 0:
        check_zero_optimizer_groups(engine, groups)
    reference = train_plain_fmoe(rank, groups)
    for (name, p), q in zip(engine.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=lambda m: f"stage {stage} {name}: {m}")


def _entry(rank, world, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    init_gloo_from_env()                           # DeepSpeed takes the group made here
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    exit_without_teardown()


def run_deepspeed_ranks(fn, world, *args):
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)


@pytest.mark.parametrize("stage,ep_size", [(0, 2), (1, 2), (2, 2), (2, 1)])
def test_zero_stage_trains_like_plain_fmoe(stage, ep_size):
    run_deepspeed_ranks(check_stage, 2, stage, ep_size)


def test_markings_and_optimizer_groups():
    model = TinyLM(ParallelGroups(ep_size=1, dp_size=1, moe_group=None, expert_dp_group=None))
    assert fds.mark_expert_params(model) == 1
    experts = set(model.moe.experts.parameters())
    assert all(p.allreduce is False and p.group_name == "ep_size_1" for p in experts)
    assert isinstance(model.moe.deepspeed_marker, deepspeed.moe.layer.MoE)
    assert sum(p.numel() for p in model.moe.deepspeed_marker.parameters()) == 0
    groups = fds.moe_param_groups(model, weight_decay=0.1)
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"params", "ep_size_1"}
    assert by_name["ep_size_1"]["moe"] and set(by_name["ep_size_1"]["params"]) == experts
    assert by_name["ep_size_1"]["weight_decay"] == 0.1
    assert not experts & set(by_name["params"]["params"])


def test_clear_errors():
    with pytest.raises(ValueError, match="no fmoe layer"):
        fds.mark_expert_params(nn.Linear(2, 2))
    model = TinyLM(ParallelGroups(ep_size=1, dp_size=1, moe_group=None, expert_dp_group=None))
    with pytest.raises(ValueError, match="mark_expert_params"):
        fds.moe_param_groups(model)
    fds.mark_expert_params(model)
    with pytest.raises(ValueError, match="unique 'name'"):
        fds.moe_param_groups(model, [{"params": list(model.parameters())}])
    with pytest.raises(ValueError, match="init_distributed"):
        fds.setup_expert_parallel(2)


def test_example_runs_under_the_launcher(tmp_path):
    """examples/deepspeed/train.py on 2 CPU ranks (ep 2, ZeRO 2); its checkpoint loads into one process."""
    gpt = pytest.importorskip("fmoe.app.gpt")
    from fmoe.distributed.checkpoint import load_checkpoint

    root = Path(__file__).resolve().parents[1]
    args = ["--steps", "4", "--experts", "4", "--layers", "1", "--d-model", "32", "--d-hidden", "64",
            "--seq-len", "32", "--data", str(root / "fmoe"), "--out", str(tmp_path)]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--no_local_rank",
           "--master_port", str(free_port()), str(root / "examples" / "deepspeed" / "train.py"), *args]
    run = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "validation loss" in run.stdout
    model = gpt.GPT(gpt.GPTConfig(seq_len=32, d_model=32, n_layer=1, num_expert=4, d_hidden=64))
    load_checkpoint(str(tmp_path / "checkpoint"), model)

