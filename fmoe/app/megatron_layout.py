"""Megatron-Core's MoE checkpoint layout for `fmoe convert`: its per-rank torch files
(`iter_<n>/mp_rank_00[_<pp rank>][_<ep rank>]/model_optim_rng.pt`), its expert tensors (SequentialMLP's
`local_experts.<i>.linear_fc1.weight` or TEGroupedMLP's `linear_fc1.weight<i>`, transposed from
fmoe's) and router, pipeline stages and expert-parallel ranks, read into and written from a
`MoECheckpoint` (`fmoe.app.layouts`). The layout in full: `fmoe.app.convert`'s docstring."""
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

import torch

from fmoe.app import checkpoints
from fmoe.app.checkpoints import CheckpointError
from fmoe.app.files import save_torch, write_text
from fmoe.app.layouts import MoECheckpoint, save_hf_config

MEGATRON_FILE = "model_optim_rng.pt"
LATEST = "latest_checkpointed_iteration.txt"
LAYOUTS = ("sequential", "grouped")
MEGATRON_RANK = re.compile(r"mp_rank_00(_(?P<a>\d{3}))?(_(?P<b>\d{3}))?")
DECODER_LAYER = re.compile(r"^decoder\.layers\.(?P<i>\d+)\.")
LAST_STAGE = ("decoder.final_layernorm.", "output_layer.")
# Router tensors whose size says how many experts a Megatron MoE layer has in all: tensor -> that dimension.
ROUTER_EXPERT_DIM = {"weight": 0, "fmoe_gate.w_gate": 1}
# fmoe's per-expert tensor <-> Megatron's, and whether it is stored transposed.
TO_MEGATRON = {"w1_eDF": ("linear_fc1.weight", True), "b1_eF": ("linear_fc1.bias", False),
               "w2_eFD": ("linear_fc2.weight", True), "b2_eD": ("linear_fc2.bias", False)}
FROM_MEGATRON = {v[0]: (k, v[1]) for k, v in TO_MEGATRON.items()}
SEQUENTIAL = re.compile(r"^(?P<layer>.+)\.experts\.local_experts\.(?P<i>\d+)\.(?P<param>linear_fc[12]\.(weight|bias))$")
GROUPED = re.compile(r"^(?P<layer>.+)\.experts\.(?P<param>linear_fc[12]\.(weight|bias))(?P<i>\d+)$")


def megatron_layer(layer: str) -> str:
    if not layer.endswith(".moe"):
        raise ValueError(f"an fmoe layer {layer!r} maps to Megatron's MoE layer only as <X>.moe -> <X> "
                         "(as MegatronMLP and the fmoe models name it)")
    return layer[:-len(".moe")]


def write_megatron(ckpt: MoECheckpoint, path: str, ep_size: int = 1, layout: str = "sequential",
                   pp_size: int = 1) -> int:
    for name, size in (("--ep-size", ep_size), ("--pp-size", pp_size)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"--expert-layout must be one of {LAYOUTS}, got {layout!r}")
    stage_of = pipeline_stages(ckpt, pp_size)
    shared: List[dict] = [{} for _ in range(pp_size)]
    for name, tensor in ckpt.dense.items():
        prefix, sep, rest = name.partition(".gate.")
        if sep and prefix in ckpt.experts:
            rest = {"gate.proj.weight": "weight", "gate.proj.bias": "bias"}.get(rest, f"fmoe_gate.{rest}")
            name = f"{megatron_layer(prefix)}.router.{rest}"
        stage, name = stage_of(name)
        shared[stage][name] = tensor
    ranks: Dict[tuple, dict] = {(p, r): dict(shared[p]) for p in range(pp_size) for r in range(ep_size)}
    written = 0
    for layer, params in ckpt.experts.items():
        num = ckpt.num_experts(layer)
        if num % ep_size:
            raise ValueError(f"--ep-size {ep_size} must divide the {num} experts of layer {layer}")
        local = num // ep_size
        stage, name_of_layer = stage_of(f"{megatron_layer(layer)}.")
        for param, slot in params.items():
            name, transposed = TO_MEGATRON[param]
            for g, tensor in slot.items():
                i = g % local
                key = (f"{name_of_layer}experts.local_experts.{i}.{name}" if layout == "sequential"
                       else f"{name_of_layer}experts.{name}{i}")
                ranks[stage, g // local][key] = (tensor.t() if transposed else tensor).contiguous()
                written += 1
    folder = os.path.join(path, "iter_0000000")
    for (stage, r), state in ranks.items():
        name = "mp_rank_00" + (f"_{stage:03d}" if pp_size > 1 else "") + (f"_{r:03d}" if ep_size > 1 else "")
        save_torch(os.path.join(folder, name, MEGATRON_FILE), {"model": state, "checkpoint_version": 3.0,
                                                               "iteration": 0})
    write_text(os.path.join(path, LATEST), "0")
    save_hf_config(ckpt, path)
    return written


def pipeline_stages(ckpt: MoECheckpoint, pp_size: int):
    """name -> (its pipeline stage, its name there): `decoder.layers.<i>` split evenly in order and
    numbered from 0 on each stage, the final norm and output layer on the last stage, the rest on the first."""
    if pp_size == 1:
        return lambda name: (0, name)
    layers = sorted({int(m["i"]) for m in map(DECODER_LAYER.match, list(ckpt.dense) + list(ckpt.experts)) if m})
    if layers != list(range(len(layers))) or not layers:
        raise ValueError(f"--pp-size {pp_size}: the checkpoint's transformer layers must be decoder.layers.0..L-1 "
                         f"(Megatron-Core's GPT), found {layers[:8]}")
    if len(layers) % pp_size:
        raise ValueError(f"--pp-size {pp_size} must divide the {len(layers)} layers (decoder.layers.<i>)")
    per_stage = len(layers) // pp_size

    def stage_of(name: str):
        match = DECODER_LAYER.match(name)
        if match:
            i = int(match["i"])
            return i // per_stage, f"decoder.layers.{i % per_stage}.{name[match.end():]}"
        return (pp_size - 1 if name.startswith(LAST_STAGE) else 0), name

    return stage_of


def megatron_iteration_folder(path: str) -> str:
    """The folder `latest_checkpointed_iteration.txt` names: `iter_<7 digits>`, or `release` (Megatron's name
    for a checkpoint outside training)."""
    latest = os.path.join(path, LATEST)
    with open(latest, errors="replace") as f:
        iteration = f.read().strip()
    if iteration == "release":
        return os.path.join(path, "release")
    if not iteration.isdigit():
        raise CheckpointError(f"{latest} holds {iteration[:40]!r}: expected an iteration number or 'release'")
    return os.path.join(path, f"iter_{int(iteration):07d}")


def megatron_rank_folders(folder: str) -> Dict[str, tuple]:
    """Each rank folder -> its suffixes: (pipeline rank, expert rank), or one number (either)."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}, the folder {LATEST} names, does not exist")
    names = sorted(d for d in os.listdir(folder) if d.startswith("mp_rank_"))
    if not names:
        raise CheckpointError(f"no mp_rank_* folders in {folder}")
    matches = {d: MEGATRON_RANK.fullmatch(d) for d in names}
    if not all(matches.values()):
        raise ValueError(f"{folder}: {names} include tensor-parallel ranks; only pipeline and expert-parallel "
                         "shards (mp_rank_00[_<pp rank>][_<ep rank>]) convert")
    shapes = {(m["a"] is not None) + (m["b"] is not None) for m in matches.values()}
    if len(shapes) > 1:
        raise CheckpointError(f"{folder} mixes rank folder names of different forms: {names[:4]}")
    return {d: tuple(int(m[k]) for k in ("a", "b") if m[k] is not None) for d, m in matches.items()}


def check_ranks_complete(folder: str, ranks: Dict[tuple, str], name_of):
    """Every pipeline rank x every expert-parallel rank up to the largest seen has its folder; a missing
    one is named (`name_of(pipeline rank, expert rank)`)."""
    stages = range(max(r[0] for r in ranks) + 1)
    experts = range(max(r[1] for r in ranks) + 1)
    missing = [name_of(p, e) for p in stages for e in experts if (p, e) not in ranks]
    if missing:
        raise CheckpointError(f"{folder}: rank folder(s) {', '.join(missing[:8])} missing")


def megatron_local_experts(state: dict) -> Dict[str, set]:
    local = defaultdict(set)
    for key in state:
        match = SEQUENTIAL.match(key) or GROUPED.match(key)
        if match:
            local[match["layer"]].add(int(match["i"]))
    return local


def holds_all_experts(state: dict) -> bool:
    """Whether every MoE layer of this rank file holds as many experts as its router routes to."""
    local = megatron_local_experts(state)
    for key, tensor in state.items():
        prefix, sep, rest = key.partition(".router.")
        if sep and rest in ROUTER_EXPERT_DIM and prefix in local:
            if len(local[prefix]) < tensor.shape[ROUTER_EXPERT_DIM[rest]]:
                return False
    return True


def read_megatron(path: str) -> MoECheckpoint:
    folder = megatron_iteration_folder(path)
    suffixes = megatron_rank_folders(folder)
    states = {}
    for name in suffixes:
        where = os.path.join(folder, name, MEGATRON_FILE)
        checkpoints.check_zip_records(Path(where), "Megatron rank file")
        state = checkpoints.read_torch(Path(where), "Megatron rank file").get("model")
        if not isinstance(state, dict):
            raise CheckpointError(f"Megatron rank file {where} holds no 'model' state dict")
        states[name] = state
    one = {len(v) for v in suffixes.values()} == {1}
    as_stages = one and len(suffixes) > 1 and all(holds_all_experts(s) for s in states.values())
    ranks = {}      # (pipeline rank, expert rank) -> folder name
    for name, numbers in suffixes.items():
        key = numbers if len(numbers) == 2 else (numbers + (0,) if as_stages else (0,) + numbers) if numbers else (0, 0)
        ranks[key] = name
    form = next(iter(suffixes.values()))

    def name_of(stage: int, ep_rank: int) -> str:
        numbers = (stage, ep_rank) if len(form) == 2 else (stage,) if as_stages else (ep_rank,) if form else ()
        return "mp_rank_00" + "".join(f"_{n:03d}" for n in numbers)

    check_ranks_complete(folder, ranks, name_of)
    offsets, offset = {}, 0         # each stage's first global layer: the layers of the stages before
    for stage in sorted({r[0] for r in ranks}):
        offsets[stage] = offset
        offset += len({int(m["i"]) for m in map(DECODER_LAYER.match, states[ranks[stage, 0]]) if m})
    ckpt, local_counts, num_experts = MoECheckpoint(), defaultdict(dict), {}     # layer -> {rank: local experts}
    for (stage, ep_rank), name in sorted(ranks.items()):
        where = os.path.join(folder, name, MEGATRON_FILE)
        state = {renumber(k, offsets[stage]): v for k, v in states[name].items()}
        local = megatron_local_experts(state)
        for key, tensor in state.items():
            match = SEQUENTIAL.match(key) or GROUPED.match(key)
            if match:
                param, transposed = FROM_MEGATRON[match["param"]]
                g = ep_rank * len(local[match["layer"]]) + int(match["i"])
                ckpt.add_expert(f"{match['layer']}.moe", param, g, tensor.t() if transposed else tensor, where)
                continue
            prefix, sep, rest = key.partition(".router.")
            if sep and rest in ROUTER_EXPERT_DIM:
                num_experts[f"{prefix}.moe"] = tensor.shape[ROUTER_EXPERT_DIM[rest]]
            if sep:
                rest = {"weight": "gate.proj.weight", "bias": "gate.proj.bias"}.get(rest, rest[len("fmoe_gate."):])
                key = f"{prefix}.moe.gate.{rest}"
            if ep_rank == 0:
                if key in ckpt.dense and not torch.equal(ckpt.dense[key], tensor):
                    raise ValueError(f"SRC {path!r}: {key} differs between pipeline stages")
                ckpt.dense[key] = tensor
            elif key not in ckpt.dense:
                raise ValueError(f"SRC {path!r}: {key} is on expert-parallel rank {ep_rank} but not on rank 0")
        for layer, ids in local.items():
            local_counts[f"{layer}.moe"][ep_rank] = len(ids)
    num_ep = len({r[1] for r in ranks})
    for layer, counts in local_counts.items():
        check_megatron_experts(folder, layer, counts, num_experts.get(layer), num_ep)
    return ckpt


def renumber(key: str, offset: int) -> str:
    """A pipeline stage's `decoder.layers.<i>` as the whole model's `decoder.layers.<offset + i>`."""
    match = DECODER_LAYER.match(key)
    if not match or not offset:
        return key
    return f"decoder.layers.{int(match['i']) + offset}.{key[match.end():]}"


def check_megatron_experts(folder: str, layer: str, counts: Dict[int, int], num_experts: Optional[int],
                           num_ranks: int):
    """Every rank folder holds as many of `layer`'s experts as the first, and as many as the router routes to
    (`num_experts`, where it says) are there: a missing last rank folder leaves fewer."""
    local = counts.get(0, 0)
    uneven = {r: n for r, n in counts.items() if n != local}
    if uneven or len(counts) != num_ranks:
        raise CheckpointError(f"{folder}: layer {layer} has {local} local experts in rank folder 0, but "
                              f"{uneven or 'none in some of the others'}")
    if num_experts is None or num_experts == local * num_ranks:
        return
    missing = ""
    if num_experts % local == 0 and num_experts // local > num_ranks:
        missing = "; expert-parallel rank folder(s) {} missing".format(
            ", ".join(f"mp_rank_00_{r:03d}" for r in range(num_ranks, num_experts // local)))
    raise CheckpointError(f"{folder}: layer {layer}'s router has {num_experts} experts, its {num_ranks} rank "
                          f"folder(s) hold {local * num_ranks}{missing}")
