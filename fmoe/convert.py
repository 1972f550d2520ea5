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
- **hf**: a transformers MoE model's own folder (config.json, *.safetensors) in its family's layout.
  Read: `from_pretrained`, `fmoe.hf.convert`, the fmoe checkpoint state (every tensor must load).
  Written: the HF config's model built on the meta device, converted, filled from the checkpoint
  and `fmoe.hf.export`ed, so both directions use fmoe.hf's one mapping. The HF config comes from
  `--hf-config` (a folder with config.json, e.g. the original model's) or the config.json that
  SRC carries: converting from HF writes it into DST, fmoe and Megatron layouts alike.

Every other model tensor keeps its name. Optimizer states are not converted (the count is reported).
The expert tensors read and written are counted and must agree; a layer missing an expert's tensor
is an error, never a silent drop.
"""
import argparse
import contextlib
import os
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

FORMATS = ("fmoe", "megatron", "hf")
LAYOUTS = ("sequential", "grouped")
FMOE_EXPERT = re.compile(r"^(?P<layer>.+)\.experts\.(?P<param>w1_eDF|w2_eFD|b1_eF|b2_eD)@expert(?P<g>\d+)$")
USER_EXPERT = re.compile(r"\.experts\.\d+\.")     # a user expert module's tensor, by global id
MEGATRON_FILE = "model_optim_rng.pt"
LATEST = "latest_checkpointed_iteration.txt"
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

    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in stored.items()
               if k.startswith("model/") and isinstance(m, TensorStorageMetadata)}
    if not tensors:
        raise ValueError(f"SRC {path!r}: no model/ tensors in this checkpoint")
    with single_process():
        dcp.load(tensors, checkpoint_id=path, no_dist=True)
    return add_tensors(MoECheckpoint(skipped=len(stored) - len(tensors)),
                       {key[len("model/"):]: t for key, t in tensors.items()}, path)


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


def write_megatron(ckpt: MoECheckpoint, path: str, ep_size: int = 1, layout: str = "sequential") -> int:
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"--ep-size must be a positive int, got {ep_size!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"--expert-layout must be one of {LAYOUTS}, got {layout!r}")
    shared = {}
    for name, tensor in ckpt.dense.items():
        prefix, sep, rest = name.partition(".gate.")
        if sep and prefix in ckpt.experts:
            rest = {"gate.proj.weight": "weight", "gate.proj.bias": "bias"}.get(rest, f"fmoe_gate.{rest}")
            name = f"{megatron_layer(prefix)}.router.{rest}"
        shared[name] = tensor
    ranks: List[dict] = [dict(shared) for _ in range(ep_size)]
    written = 0
    for layer, params in ckpt.experts.items():
        num = ckpt.num_experts(layer)
        if num % ep_size:
            raise ValueError(f"--ep-size {ep_size} must divide the {num} experts of layer {layer}")
        local = num // ep_size
        for param, slot in params.items():
            name, transposed = TO_MEGATRON[param]
            for g, tensor in slot.items():
                i = g % local
                key = (f"{megatron_layer(layer)}.experts.local_experts.{i}.{name}" if layout == "sequential"
                       else f"{megatron_layer(layer)}.experts.{name}{i}")
                ranks[g // local][key] = (tensor.t() if transposed else tensor).contiguous()
                written += 1
    folder = os.path.join(path, "iter_0000000")
    for r, state in enumerate(ranks):
        rank_dir = os.path.join(folder, "mp_rank_00" if ep_size == 1 else f"mp_rank_00_{r:03d}")
        os.makedirs(rank_dir, exist_ok=True)
        torch.save({"model": state, "checkpoint_version": 3.0, "iteration": 0}, os.path.join(rank_dir, MEGATRON_FILE))
    with open(os.path.join(path, LATEST), "w") as f:
        f.write("0")
    save_hf_config(ckpt, path)
    return written


def read_megatron(path: str) -> MoECheckpoint:
    with open(os.path.join(path, LATEST)) as f:
        folder = os.path.join(path, f"iter_{int(f.read().strip()):07d}")
    dirs = sorted(d for d in os.listdir(folder) if d.startswith("mp_rank_")) if os.path.isdir(folder) else []
    if not dirs:
        raise ValueError(f"SRC {path!r}: no mp_rank_* folders in {folder}")
    if any(not re.fullmatch(r"mp_rank_00(_\d{3})?", d) for d in dirs):
        raise ValueError(f"SRC {path!r}: {dirs} include tensor- or pipeline-parallel ranks; only expert-parallel "
                         "shards (mp_rank_00[_<ep rank>]) convert")
    states = [torch.load(os.path.join(folder, d, MEGATRON_FILE), map_location="cpu", weights_only=True)["model"]
              for d in dirs]
    ckpt = MoECheckpoint()
    for ep_rank, state in enumerate(states):
        local = defaultdict(set)
        for key in state:
            match = SEQUENTIAL.match(key) or GROUPED.match(key)
            if match:
                local[match["layer"]].add(int(match["i"]))
        for key, tensor in state.items():
            match = SEQUENTIAL.match(key) or GROUPED.match(key)
            if match:
                param, transposed = FROM_MEGATRON[match["param"]]
                g = ep_rank * len(local[match["layer"]]) + int(match["i"])
                ckpt.add_expert(f"{match['layer']}.moe", param, g, tensor.t() if transposed else tensor,
                                os.path.join(folder, dirs[ep_rank]))
                continue
            prefix, sep, rest = key.partition(".router.")
            if sep:
                rest = {"weight": "gate.proj.weight", "bias": "gate.proj.bias"}.get(rest, rest[len("fmoe_gate."):])
                key = f"{prefix}.moe.gate.{rest}"
            if ep_rank == 0:
                ckpt.dense[key] = tensor
            elif key not in ckpt.dense:
                raise ValueError(f"SRC {path!r}: {key} is on expert-parallel rank {ep_rank} but not on rank 0")
    return ckpt


def read_hf(path: str) -> MoECheckpoint:
    """An HF MoE model folder as fmoe's checkpoint of it converted (at EP 1); every tensor must load."""
    import transformers

    import fmoe.hf
    from fmoe.distributed.checkpoint import checkpoint_state

    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto", output_loading_info=True)
    wrong = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if wrong:
        raise ValueError(f"SRC {path!r} does not load as its config's model: "
                         + "; ".join(f"{k}: {sorted(v)[:8]}" for k, v in wrong.items()))
    fmoe.hf.convert(model)
    state = {key[len("model/"):]: t.detach() for key, t in checkpoint_state(model).items()}
    ckpt = add_tensors(MoECheckpoint(), state, path)
    ckpt.hf_config = model.config
    return ckpt


def write_hf(ckpt: MoECheckpoint, path: str) -> int:
    """The HF config's model, built on the meta device and converted, takes the checkpoint's tensors
    (all of them, each once) and is exported in its family's layout; returns the expert tensors used."""
    import transformers

    import fmoe.hf
    from fmoe.layer import FMoE

    if ckpt.hf_config is None:
        raise ValueError("--to hf needs the model's HF config: pass --hf-config FOLDER (with config.json, e.g. the "
                         f"original model's), or keep the {HF_CONFIG} a conversion from HF wrote into SRC")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(ckpt.hf_config)
    fmoe.hf.convert(model)
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
    fmoe.hf.export(model, path)
    ckpt.skipped += len(recomputed & set(ckpt.dense))
    return written


def convert(src: str, dst: str, to: str, ep_size: int = 1, layout: str = "sequential",
            hf_config: Optional[str] = None) -> dict:
    """Convert `src` into `dst` in the `to` layout (`hf_config`: a folder with the model's HF
    config.json, which `--to hf` needs unless SRC carries one); returns what was counted."""
    if to not in FORMATS:
        raise ValueError(f"--to must be one of {FORMATS}, got {to!r}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("SRC and DST must differ")
    ckpt = read(src)
    if hf_config is not None:
        ckpt.hf_config = load_hf_config(hf_config)
    count_in = ckpt.check_whole(src)
    writers = {"megatron": lambda: write_megatron(ckpt, dst, ep_size, layout), "fmoe": lambda: write_fmoe(ckpt, dst),
               "hf": lambda: write_hf(ckpt, dst)}
    written = writers[to]()
    count_out = read(dst).check_whole(dst)
    if not written == count_out == count_in:
        raise ValueError(f"read {count_in} expert tensors from {src}, wrote {written}, {dst} holds {count_out}: "
                         "nothing may be dropped")
    return {"expert_tensors": count_in, "layers": len(ckpt.experts), "dense_tensors": len(ckpt.dense),
            "not_converted": ckpt.skipped}


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("src", metavar="SRC", help="an fmoe, Megatron-Core or HF (config.json + safetensors) checkpoint "
                                               "folder")
    p.add_argument("dst", metavar="DST", help="the folder to write")
    p.add_argument("--to", required=True, choices=FORMATS, help="the layout to write")
    p.add_argument("--ep-size", type=int, default=1, help="Megatron: expert-parallel ranks to shard the experts over")
    p.add_argument("--expert-layout", choices=LAYOUTS, default="sequential",
                   help="Megatron: SequentialMLP's local_experts.<i>.linear_fc1 or TEGroupedMLP's linear_fc1.weight<i>")
    p.add_argument("--hf-config", metavar="FOLDER", default=None,
                   help="hf: a folder with the model's HF config.json (the original model's), unless SRC carries one")


def run(args):
    if args.to == "hf" or os.path.isfile(os.path.join(args.src, HF_CONFIG)):
        import transformers
        transformers.utils.logging.disable_progress_bar()      # the summary below says what was loaded
    counts = convert(args.src, args.dst, args.to, args.ep_size, args.expert_layout, args.hf_config)
    print(f"{args.dst}: {counts['expert_tensors']} expert tensors in {counts['layers']} MoE layers (as many as read) "
          f"and {counts['dense_tensors']} other tensors; {counts['not_converted']} entries not converted "
          "(optimizer states, extras, buffers HF rebuilds)")
