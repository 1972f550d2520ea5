"""Outputs and gradients of the layer, saved from a known commit, to hold a restructuring of the
layer's path to bit-identical results: every gate, recompute mode and exchange at 1, 2 and 4 ranks.

Write them (on the commit to hold to): `python -m tests.layer_golden --write` (all three worlds;
gloo processes for 2 and 4). `tests/test_layer_golden.py` compares against them.
"""
import argparse
import os
from typing import Dict, List

import torch

import fmoe
from fmoe.gates import GATES

D, H, E = 8, 12, 2          # d_model, d_hidden, experts per rank
GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def path_of(world: int) -> str:
    return os.path.join(GOLDEN, f"layer-w{world}.pt")


def configs(world: int) -> List[dict]:
    """Named layer configurations for `world` ranks: FMoE keywords plus the harness's own keys
    (`kind`: how the experts are made; `input`: tensor, 3-D or tree; `dtype`)."""
    out = []
    if world == 1:
        for gate in sorted(GATES):
            for recompute in ("activation", "experts", "none"):
                out.append(dict(name=f"{gate}-{recompute}", gate=gate, recompute=recompute, num_expert=4,
                                top_k=1 if gate == "switch" else 2))
        for recompute in ("activation", "none"):
            out += [dict(name=f"swiglu-{recompute}", activation="swiglu", recompute=recompute, expert_bias=False),
                    dict(name=f"shared-{recompute}", shared_expert=16, shared_expert_gate=True, recompute=recompute),
                    dict(name=f"bf16-{recompute}", dtype=torch.bfloat16, recompute=recompute),
                    dict(name=f"3d-{recompute}", input="3d", recompute=recompute)]
        out += [dict(name="fp32-combine", fp32_combine=True, dtype=torch.bfloat16),
                dict(name="top1", top_k=1),
                dict(name="module-list", kind="module_list"),
                dict(name="mask", kind="mask"),
                dict(name="tree", kind="tree", input="tree")]
        return out
    per_node = 2 if world == 4 else 1
    for exchange in ("slot", "rank", "node"):
        kw = dict(exchange=exchange, ranks_per_node=per_node)
        for recompute in ("activation", "experts", "none"):
            out.append(dict(name=f"{exchange}-{recompute}", recompute=recompute, **kw))
        out += [dict(name=f"{exchange}-gshard", gate="gshard", **kw),
                dict(name=f"{exchange}-swiglu", activation="swiglu", **kw),
                dict(name=f"{exchange}-top3", top_k=3, **kw),
                dict(name=f"{exchange}-shadow", shadow=[0], **kw),
                dict(name=f"{exchange}-shadow-none", shadow=[0, world * E - 1], recompute="none", **kw),
                dict(name=f"{exchange}-shadow-modules", shadow=[1], kind="module_list", **kw),
                dict(name=f"{exchange}-modules", kind="module_list", **kw),
                dict(name=f"{exchange}-shared", shared_expert=16, **kw),
                dict(name=f"{exchange}-bf16", dtype=torch.bfloat16, **kw)]
        if exchange != "slot":
            out += [dict(name=f"{exchange}-sync-free", sync_free=True, max_tokens_per_rank=16, **kw),
                    dict(name=f"{exchange}-sync-free-overflow", sync_free=True, max_tokens_per_rank=2, **kw)]
        if exchange != "node":
            out += [dict(name=f"{exchange}-schedule", schedule=True, **kw),
                    dict(name=f"{exchange}-schedule-shadow", schedule=True, shadow=[0], schedule_group_size=2, **kw),
                    dict(name=f"{exchange}-tree", kind="tree", input="tree", **kw)]
    return out


def build(cfg: dict, world: int):
    from tests.shadow_workers import FixedShadow, TinyExpert
    from tests.test_fastmoe_compat import DictExperts, DictGate
    kw = {k: v for k, v in cfg.items() if k not in ("name", "kind", "input", "dtype")}
    kw.setdefault("num_expert", E)
    kw.setdefault("top_k", 2)
    if "shadow" in kw:
        kw["shadow"] = FixedShadow(kw["shadow"])
    kind = cfg.get("kind", "grouped")
    torch.manual_seed(0)
    if kind == "module_list":
        layer = fmoe.FMoE(d_model=D, world_size=world, expert=TinyExpert, **kw)
    elif kind == "tree":
        layer = fmoe.FMoE(d_model=D, world_size=world, gate=DictGate, **kw)
        layer.experts = DictExperts(kw["num_expert"], D, H)
    elif kind == "mask":
        mask = torch.tensor([0, 1, 0, 2, 0, 0, 1, 0, 0, 0, 0, 0])
        layer = fmoe.FMoETransformerMLP(d_model=D, d_hidden=H, world_size=world, mask=mask,
                                        mask_dict={1: torch.full((D,), 0.5), 2: torch.arange(D) / D}, **kw)
    else:
        layer = fmoe.FMoETransformerMLP(d_model=D, d_hidden=H, world_size=world, **kw)
    return layer.to(cfg.get("dtype", torch.float32))


def run(cfg: dict, rank: int, world: int) -> Dict[str, torch.Tensor]:
    """One forward and backward of `cfg` on this rank: output, input and parameter gradients, aux loss."""
    layer = build(cfg, world)
    dtype = cfg.get("dtype", torch.float32)
    torch.manual_seed(10 + rank)        # each rank's experts differ, the same on every run
    with torch.no_grad():
        for p in layer.experts.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = 12 if cfg.get("kind") == "mask" else 10 + 3 * rank
    x = torch.randn(tokens, D, generator=g).to(dtype)
    if cfg.get("input") == "3d":
        x = x.reshape(2, tokens // 2, D)
    x.requires_grad_(True)
    torch.manual_seed(77)               # the noisy gates' noise
    if cfg.get("input") == "tree":
        z = torch.randn(tokens, D, generator=g).requires_grad_(True)
        out = layer({"x": x, "y": z})
        (out["x"] * 2 + out["y"] ** 2).sum().backward()
        result = {"out.x": out["x"], "out.y": out["y"], "grad.x": x.grad, "grad.z": z.grad}
    else:
        out = layer(x)
        (out.float() * torch.randn(out.shape, generator=g)).sum().backward()
        result = {"out": out, "grad.x": x.grad}
    if layer.aux_loss is not None:
        result["aux_loss"] = layer.aux_loss
    for n, p in layer.named_parameters():
        if p.grad is not None:
            result[f"grad.{n}"] = p.grad
    return {k: v.detach().clone() for k, v in result.items()}


def canary() -> torch.Tensor:
    """A fixed GEMM + softmax: when this machine computes it to other bits than the golden's,
    its arithmetic differs, and the comparison can only be close, not bitwise."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(13, 37, generator=g), torch.randn(37, 11, generator=g)
    return torch.softmax(a @ b, -1)


def run_world(rank: int, world: int) -> Dict[str, Dict[str, torch.Tensor]]:
    return {cfg["name"]: run(cfg, rank, world) for cfg in configs(world)}


def _write_rank(rank, world, folder):
    torch.save(run_world(rank, world), os.path.join(folder, f"rank{rank}.pt"))


def write(world: int):
    import tempfile
    from tests.dist_utils import run_ranks
    if world == 1:
        ranks = [run_world(0, 1)]
    else:
        with tempfile.TemporaryDirectory() as folder:
            run_ranks(_write_rank, world, folder)
            ranks = [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(world)]
    os.makedirs(GOLDEN, exist_ok=True)
    torch.save({"canary": canary(), "torch": str(torch.__version__), "ranks": ranks}, path_of(world))
    print(f"wrote {path_of(world)}: {len(ranks[0])} configurations x {world} ranks")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write tests/golden/layer-w{1,2,4}.pt")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    if not args.write:
        parser.error("pass --write (the test compares; this writes)")
    for w in args.worlds:
        write(w)
