"""A MoE checkpoint in no layout (`MoECheckpoint`: dense tensors by fmoe name, experts by layer,
parameter and global id), read from and written to fmoe's `torch.distributed.checkpoint` folders and
HF transformers model folders. Megatron-Core's layout is `fmoe.app.megatron_layout`; `fmoe convert`
(`fmoe.app.convert`) picks the layout, checks SRC and stages DST."""
import contextlib
import os
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException

from fmoe.app.checkpoints import CheckpointError, unreadable
from fmoe.distributed import safe_load
from fmoe.distributed.safe_load import UnsafeCheckpointError

FMOE_EXPERT = re.compile(r"^(?P<layer>.+)\.experts\.(?P<param>w1_eDF|w2_eFD|b1_eF|b2_eD)@expert(?P<g>\d+)$")
USER_EXPERT = re.compile(r"\.experts\.\d+\.")     # a user expert module's tensor, by global id
HF_CONFIG = "config.json"


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


def load_hf_config(path: str):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path)


def save_hf_config(ckpt: MoECheckpoint, path: str):
    """Carry the HF config along, so converting back to HF needs no --hf-config."""
    if ckpt.hf_config is not None:
        ckpt.hf_config.to_json_file(os.path.join(path, HF_CONFIG))


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
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = safe_load.read_metadata(path)
    except UnsafeCheckpointError:
        raise
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
            safe_load.load(tensors, path, no_dist=True)
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
