"""`fmoe convert SRC DST --to fmoe|megatron|hf`: MoE checkpoints between fmoe's, Megatron-Core's and
HuggingFace's layouts.

- **fmoe**: a `torch.distributed.checkpoint` folder from `fmoe.distributed.checkpoint.save_checkpoint`
  or `fmoe.distributed.fsdp.save_checkpoint` (plain or FSDP2 runs, any expert-parallel size): every
  expert stored by global id, `model/<layer>.experts.w1_eDF@expert<g>` ([D, F]; w2 [F, D], b1, b2).
- **megatron**: Megatron-Core's own MoE layout in its per-rank torch checkpoint
  (`iter_0000000/mp_rank_00[_<ep rank>]/model_optim_rng.pt`, `{"model": state_dict}`): an fmoe layer
  `<X>.moe` becomes Megatron's MoE layer `<X>`, its experts
  `<X>.experts.local_experts.<i>.linear_fc1.weight` ([F, D]; `linear_fc2` [D, F]; `--expert-layout
  grouped`: `<X>.experts.linear_fc1.weight<i>`), numbered per expert-parallel rank (`--ep-size`), and
  its gate's projection `<X>.router.weight` / `.bias` (other gate tensors: `<X>.router.fmoe_gate.*`).
  Pipeline-sharded (`--pp-size`): `mp_rank_00_<pp rank>[_<ep rank>]`, each stage its share of the
  `decoder.layers.<i>` numbered from 0 as Megatron-Core numbers them, the embedding on the first
  stage, the final norm and output layer on the last. Read back, a folder with one suffix is a
  pipeline stage when it holds all its layers' experts, an expert-parallel rank otherwise.
- **hf**: a transformers MoE model's own folder (config.json, *.safetensors) in its family's layout.
  Read: `from_pretrained`, `fmoe.integrations.hf.convert`, the fmoe checkpoint state (every tensor
  must load). Written: the HF config's model built on the meta device, converted, filled from the
  checkpoint and `fmoe.integrations.hf.export`ed, so both directions use fmoe.integrations.hf's one
  mapping. The HF config comes from `--hf-config` (a folder with config.json, e.g. the original
  model's) or the config.json that SRC carries: converting from HF writes it into DST, fmoe and
  Megatron layouts alike.

Every other model tensor keeps its name. Optimizer states are not converted (the count is reported).
The expert tensors read and written are counted and must agree; a layer missing an expert's tensor
is an error, never a silent drop.

SRC is checked before anything is written: a `fmoe train` step folder against its manifest's SHA-256
checksums (the check `--resume` makes), every DCP shard against the sizes its `.metadata` records,
every safetensors file's header, and a Megatron checkpoint's rank folders by their names (its router
says how many experts a layer has, so a missing rank folder is named, never a smaller model) and its
rank files' zip records by their CRC-32s. DST is
written into a staging folder beside it and renamed into place once whole: an existing non-empty DST
is refused unless `overwrite` (then it is replaced whole), and any failure leaves DST as it was.
"""
import argparse
import contextlib
import errno
import os
import re
import shutil
import tempfile
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException

from fmoe.app import checkpoints
from fmoe.app.checkpoints import CheckpointError, unreadable
from fmoe.app.files import UMASK, WriteError, fault, fsync_dir, save_torch, write_text

FORMATS = ("fmoe", "megatron", "hf")
LAYOUTS = ("sequential", "grouped")
FMOE_EXPERT = re.compile(r"^(?P<layer>.+)\.experts\.(?P<param>w1_eDF|w2_eFD|b1_eF|b2_eD)@expert(?P<g>\d+)$")
USER_EXPERT = re.compile(r"\.experts\.\d+\.")     # a user expert module's tensor, by global id
MEGATRON_FILE = "model_optim_rng.pt"
LATEST = "latest_checkpointed_iteration.txt"
MEGATRON_RANK = re.compile(r"mp_rank_00(_(?P<a>\d{3}))?(_(?P<b>\d{3}))?")
DECODER_LAYER = re.compile(r"^decoder\.layers\.(?P<i>\d+)\.")
LAST_STAGE = ("decoder.final_layernorm.", "output_layer.")
# Router tensors whose size says how many experts a Megatron MoE layer has in all: tensor -> that dimension.
ROUTER_EXPERT_DIM = {"weight": 0, "fmoe_gate.w_gate": 1}
HF_CONFIG = "config.json"
# fmoe's per-expert tensor <-> Megatron's, and whether it is stored transposed.
TO_MEGATRON = {"w1_eDF": ("linear_fc1.weight", True), "b1_eF": ("linear_fc1.bias", False),
               "w2_eFD": ("linear_fc2.weight", True), "b2_eD": ("linear_fc2.bias", False)}
FROM_MEGATRON = {v[0]: (k, v[1]) for k, v in TO_MEGATRON.items()}
SEQUENTIAL = re.compile(r"^(?P<layer>.+)\.experts\.local_experts\.(?P<i>\d+)\.(?P<param>linear_fc[12]\.(weight|bias))$")
GROUPED = re.compile(r"^(?P<layer>.+)\.experts\.(?P<param>linear_fc[12]\.(weight|bias))(?P<i>\d+)$")


@dataclass
class MoECheckpoint:
    """A checkpoint in neither layout: dense tensors by fmoe name, experts by fmoe layer, parameter and
    global id (in fmoe's orientation)."""
    dense: Dict[str, torch.Tensor] = field(default_factory=dict)
    experts: Dict[str, Dict[str, Dict[int, torch.Tensor]]] = field(default_factory=lambda: defaultdict(dict))
    skipped: int = 0        # optimizer states and extras, which are not converted
    hf_config: Optional[object] = None      # the transformers config of a model converted from HF

    def add_expert(self, layer: str, param: str, g: int, tensor: torch.Tensor, where: str):
        slot = self.experts[layer].setdefault(param, {})
        if g in slot:
            raise ValueError(f"{where}: expert {g} of {layer}.experts.{param} appears twice")
        slot[g] = tensor

    def check_whole(self, where: str) -> int:
        """Every layer holds experts 0..E-1 for each of its parameters; returns the number of expert tensors."""
        if not self.experts:
            raise ValueError(f"{where}: no MoE expert tensors found")
        count = 0
        for layer, params in self.experts.items():
            num = max(max(slot) for slot in params.values()) + 1
            for param, slot in params.items():
                missing = sorted(set(range(num)) - set(slot))
                if missing:
                    raise ValueError(f"{where}: layer {layer} has {num} experts but no {param} for expert(s) "
                                     f"{missing[:8]}: the checkpoint is incomplete")
                count += len(slot)
        return count

    def num_experts(self, layer: str) -> int:
        return len(next(iter(self.experts[layer].values())))


@contextlib.contextmanager
def single_process():
    """Conversion runs in one process: DCP's warning that torch.distributed is off says nothing here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read(path: str) -> MoECheckpoint:
    if any(os.path.isfile(os.path.join(path, name)) for name in (checkpoints.MANIFEST, checkpoints.TRAINER_FILE)):
        checkpoints.verify_folder(Path(path))       # a `fmoe train` step folder: every file against its checksum
    if os.path.isfile(os.path.join(path, ".metadata")):
        ckpt = read_fmoe(path)
    elif os.path.isfile(os.path.join(path, LATEST)):
        ckpt = read_megatron(path)
    elif os.path.isfile(os.path.join(path, HF_CONFIG)):
        return read_hf(path)
    else:
        raise ValueError(f"SRC {path!r} is neither an fmoe checkpoint (a folder with .metadata), a Megatron one "
                         f"(a folder with {LATEST}) nor an HF model (a folder with {HF_CONFIG})")
    if os.path.isfile(os.path.join(path, HF_CONFIG)):
        ckpt.hf_config = load_hf_config(path)
    return ckpt


def load_hf_config(path: str):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path)


def add_tensors(ckpt: MoECheckpoint, tensors: Dict[str, torch.Tensor], where: str) -> MoECheckpoint:
    """Sort fmoe-named tensors into `ckpt`: experts by layer, parameter and global id, the rest dense."""
    for name, tensor in tensors.items():
        match = FMOE_EXPERT.match(name)
        if match:
            ckpt.add_expert(match["layer"], match["param"], int(match["g"]), tensor, where)
        elif USER_EXPERT.search(name):
            raise ValueError(f"SRC {where!r}: {name} is a user expert module's tensor; only fmoe's stacked MLP "
                             "experts (d_hidden=...) convert")
        else:
            ckpt.dense[name] = tensor
    return ckpt


def read_fmoe(path: str) -> MoECheckpoint:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:        # pickle's and EOF errors of a damaged file
        raise unreadable("checkpoint metadata", os.path.join(path, ".metadata"), "pickle", err) from err
    check_shard_sizes(path, metadata.storage_data)
    stored = metadata.state_dict_metadata
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in stored.items()
               if k.startswith("model/") and isinstance(m, TensorStorageMetadata)}
    if not tensors:
        raise ValueError(f"SRC {path!r}: no model/ tensors in this checkpoint")
    try:
        with single_process():
            dcp.load(tensors, checkpoint_id=path, no_dist=True)
    except CheckpointException as err:
        cause = next(iter(err.failures.values()))[0]
        raise unreadable("checkpoint", path, "torch.distributed.checkpoint", cause) from err
    return add_tensors(MoECheckpoint(skipped=len(stored) - len(tensors)),
                       {key[len("model/"):]: t for key, t in tensors.items()}, path)


def check_shard_sizes(path: str, storage_data: dict):
    """Each shard file holds at least the bytes the metadata places in it (DCP reads them without checking)."""
    ends = defaultdict(int)
    for info in storage_data.values():
        ends[info.relative_path] = max(ends[info.relative_path], info.offset + info.length)
    for name, end in sorted(ends.items()):
        shard = os.path.join(path, name)
        if not os.path.isfile(shard):
            raise CheckpointError(f"checkpoint shard {shard} is missing")
        size = os.path.getsize(shard)
        if size < end:
            raise CheckpointError(f"checkpoint shard {shard} is truncated: {size} bytes, its .metadata places "
                                  f"data up to byte {end}")


def write_fmoe(ckpt: MoECheckpoint, path: str) -> int:
    import torch.distributed.checkpoint as dcp

    state = {f"model/{k}": v for k, v in ckpt.dense.items()}
    for layer, params in ckpt.experts.items():
        for param, slot in params.items():
            state.update({f"model/{layer}.experts.{param}@expert{g}": t.contiguous() for g, t in slot.items()})
    with single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, overwrite=True), no_dist=True)
    save_hf_config(ckpt, path)
    return sum(1 for k in state if "@expert" in k)


def save_hf_config(ckpt: MoECheckpoint, path: str):
    """Carry the HF config along, so converting back to HF needs no --hf-config."""
    if ckpt.hf_config is not None:
        ckpt.hf_config.to_json_file(os.path.join(path, HF_CONFIG))


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


def read_hf(path: str) -> MoECheckpoint:
    """An HF MoE model folder as fmoe's checkpoint of it converted (at EP 1); every tensor must load."""
    import transformers

    import fmoe.integrations.hf
    from fmoe.distributed.checkpoint import checkpoint_state

    check_safetensors(path)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto", output_loading_info=True)
    wrong = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if wrong:
        raise ValueError(f"SRC {path!r} does not load as its config's model: "
                         + "; ".join(f"{k}: {sorted(v)[:8]}" for k, v in wrong.items()))
    fmoe.integrations.hf.convert(model)
    state = {key[len("model/"):]: t.detach() for key, t in checkpoint_state(model).items()}
    ckpt = add_tensors(MoECheckpoint(), state, path)
    ckpt.hf_config = model.config
    return ckpt


def check_safetensors(path: str):
    """Each *.safetensors file's header parses and its data is all there."""
    from safetensors import safe_open

    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(path, name), "pt"):
                    pass
            except Exception as err:        # safetensors' one error class, for any damage
                raise unreadable("model file", os.path.join(path, name), "safetensors", err) from err


def write_hf(ckpt: MoECheckpoint, path: str) -> int:
    """The HF config's model, built on the meta device and converted, takes the checkpoint's tensors
    (all of them, each once) and is exported in its family's layout; returns the expert tensors used."""
    import transformers

    import fmoe.integrations.hf
    from fmoe.layer import FMoE

    if ckpt.hf_config is None:
        raise ValueError("--to hf needs the model's HF config: pass --hf-config FOLDER (with config.json, e.g. the "
                         f"original model's), or keep the {HF_CONFIG} a conversion from HF wrote into SRC")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(ckpt.hf_config)
    fmoe.integrations.hf.convert(model)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FMoE)}
    if set(layers) != set(ckpt.experts):
        raise ValueError(f"the HF config's model has MoE layers {sorted(layers)[:4]}..., the checkpoint "
                         f"{sorted(ckpt.experts)[:4]}...: --hf-config describes another model")
    first = {}         # every tensor's first name (the one the checkpoint stores; tied ones are aliases)
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        first.setdefault(id(t), name)
    used, written, state = set(), 0, {}
    for key, t in model.state_dict(keep_vars=True).items():
        name = first[id(t)]
        layer, _, param = name.rpartition(".experts.")
        if layer in ckpt.experts and param in ckpt.experts[layer]:
            slot = ckpt.experts[layer][param]
            if len(slot) != layers[layer].num_expert:
                raise ValueError(f"layer {layer} has {len(slot)} experts in the checkpoint, "
                                 f"{layers[layer].num_expert} in the HF config")
            value = torch.stack([slot[g] for g in range(len(slot))])
            written += len(slot)
        elif name in ckpt.dense:
            value = ckpt.dense[name]
        else:
            raise ValueError(f"the checkpoint lacks {name}, which the HF config's model holds")
        if value.shape != t.shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)} in the checkpoint, {tuple(t.shape)} in the "
                             "HF config's model")
        used.add(name)
        state[key] = value
    recomputed = {name for name, _ in model.named_buffers()}      # non-persistent buffers HF rebuilds
    extra = sorted(set(ckpt.dense) - used - recomputed)
    if extra:
        raise ValueError(f"the HF config's model has no place for {extra[:8]}: --hf-config describes another model")
    model.load_state_dict(state, strict=True, assign=True)
    fmoe.integrations.hf.export(model, path)
    ckpt.skipped += len(recomputed & set(ckpt.dense))
    return written


def convert(src: str, dst: str, to: str, ep_size: int = 1, layout: str = "sequential",
            hf_config: Optional[str] = None, overwrite: bool = False, pp_size: int = 1) -> dict:
    """Convert `src` into `dst` in the `to` layout (`hf_config`: a folder with the model's HF
    config.json, which `--to hf` needs unless SRC carries one); returns what was counted.
    SRC is read and checked whole, then DST written beside it and renamed into place: a non-empty
    DST is refused unless `overwrite` (which replaces it whole), and on any error DST is unchanged."""
    if to not in FORMATS:
        raise ValueError(f"--to must be one of {FORMATS}, got {to!r}")
    megatron_only = {"--ep-size": (ep_size, 1), "--pp-size": (pp_size, 1), "--expert-layout": (layout, "sequential")}
    for name, (value, default) in megatron_only.items():
        if to != "megatron" and value != default:
            raise ValueError(f"{name} {value} lays out Megatron checkpoints only (--to megatron), not --to {to}: "
                             "drop it")
    if hf_config is not None and not os.path.isdir(hf_config):
        raise ValueError(f"--hf-config {hf_config}: no such folder")
    if hf_config is not None and not os.path.isfile(os.path.join(hf_config, HF_CONFIG)):
        raise ValueError(f"--hf-config {hf_config}: the folder holds no {HF_CONFIG}")
    check_destination(src, dst, overwrite)
    config = None if hf_config is None else load_hf_config(hf_config)     # the arguments before SRC
    ckpt = read(src)
    if config is not None:
        ckpt.hf_config = config
    count_in = ckpt.check_whole(src)
    writers = {"megatron": lambda path: write_megatron(ckpt, path, ep_size, layout, pp_size),
               "fmoe": lambda path: write_fmoe(ckpt, path), "hf": lambda path: write_hf(ckpt, path)}
    with staging_folder(dst) as staging:
        written = writers[to](staging)
        count_out = read(staging).check_whole(dst)
        if not written == count_out == count_in:
            raise ValueError(f"read {count_in} expert tensors from {src}, wrote {written}, {dst} would hold "
                             f"{count_out}: nothing may be dropped")
        move_into_place(staging, dst)
    return {"expert_tensors": count_in, "layers": len(ckpt.experts), "dense_tensors": len(ckpt.dense),
            "not_converted": ckpt.skipped}


def check_destination(src: str, dst: str, overwrite: bool):
    src_path, dst_path = Path(src).resolve(), Path(dst).resolve()
    if src_path == dst_path:
        raise ValueError("SRC and DST must differ")
    if dst_path in src_path.parents:
        raise ValueError(f"SRC {src!r} is inside DST {dst!r}: DST is replaced whole, choose another DST")
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise ValueError(f"DST {dst!r} exists and is not a folder")
    if os.path.isdir(dst) and os.listdir(dst) and not overwrite:
        raise ValueError(f"DST {dst!r} is a non-empty folder: pass --overwrite to replace it whole, or choose a "
                         "new DST")


def errno_under(err: BaseException) -> Optional[int]:
    """The errno of the OSError behind a writer's error (ENOSPC first): torch's zip writer keeps it as the
    context, torch.distributed.checkpoint among its failures, safetensors only as '(os error N)'."""
    found, todo, seen = [], [err], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            found.append(e.errno)
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code:
            found.append(int(code[1]))
        todo += [e.__cause__, e.__context__, *(f[0] for f in getattr(e, "failures", {}).values())]
    return errno.ENOSPC if errno.ENOSPC in found else next(iter(found), None)


@contextlib.contextmanager
def staging_folder(dst: str):
    """A fresh folder beside `dst`, removed at the end whatever happened; a failed write is one line naming DST."""
    parent = os.path.dirname(os.path.abspath(dst))
    staging = None
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(dst))}.convert.", dir=parent)
        yield staging
    except (Exception, CheckpointException) as err:       # DCP's is a BaseException
        code = None if isinstance(err, ValueError) else errno_under(err)      # a ValueError says more itself
        if code is None:
            raise
        raise WriteError(code, f"could not write {dst}: {fault(code)}; {dst} is unchanged") from err
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def move_into_place(staging: str, dst: str):
    """Rename the whole `staging` folder to `dst`; an existing `dst` is moved aside first and removed after."""
    os.chmod(staging, 0o777 & ~UMASK)        # a plain mkdir's mode, not mkdtemp's 0700
    aside = f"{staging}.replaced"
    if os.path.lexists(dst):
        os.rename(dst, aside)
    try:
        os.rename(staging, dst)
    except OSError:
        if os.path.lexists(aside):
            os.rename(aside, dst)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(dst)))
    shutil.rmtree(aside, ignore_errors=True)


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("src", metavar="SRC", help="an fmoe, Megatron-Core or HF (config.json + safetensors) checkpoint "
                                               "folder")
    p.add_argument("dst", metavar="DST", help="the folder to write (a new or empty one, unless --overwrite)")
    p.add_argument("--to", required=True, choices=FORMATS, help="the layout to write")
    p.add_argument("--ep-size", type=int, default=1, help="Megatron: expert-parallel ranks to shard the experts over")
    p.add_argument("--pp-size", type=int, default=1,
                   help="Megatron: pipeline stages to split decoder.layers.<i> over (mp_rank_00_<pp rank>[_<ep rank>])")
    p.add_argument("--expert-layout", choices=LAYOUTS, default="sequential",
                   help="Megatron: SequentialMLP's local_experts.<i>.linear_fc1 or TEGroupedMLP's linear_fc1.weight<i>")
    p.add_argument("--hf-config", metavar="FOLDER", default=None,
                   help="hf: a folder with the model's HF config.json (the original model's), unless SRC carries one")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing non-empty DST whole (only once the new one is written and checked)")


def run(args):
    if args.to == "hf" or os.path.isfile(os.path.join(args.src, HF_CONFIG)):
        import transformers
        transformers.utils.logging.disable_progress_bar()      # the summary below says what was loaded
    counts = convert(args.src, args.dst, args.to, args.ep_size, args.expert_layout, args.hf_config, args.overwrite,
                     args.pp_size)
    print(f"{args.dst}: {counts['expert_tensors']} expert tensors in {counts['layers']} MoE layers (as many as read) "
          f"and {counts['dense_tensors']} other tensors; {counts['not_converted']} entries not converted "
          "(optimizer states, extras, buffers HF rebuilds)")
