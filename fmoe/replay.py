"""Router replay (R3): record the experts every MoE layer chose, then make later forwards choose the same.

    with fmoe.record_routing(model) as trace:       # a rollout: inference, another precision, another batch shape
        model(rollout_batch)
    with fmoe.replay_routing(model, trace):         # the training step routes every token as the rollout did
        loss = model(rollout_batch).loss

A trace holds, for each MoE layer (an `FMoE`, keyed by its qualified name in the model, never by call
order) and each of its forwards, the global expert ids `[T, K]` its gate chose (-1: the slot reached no
expert). Under replay a layer's forwards take the layer's entries in order; the gate's selection step
(`BaseGate.choose`) returns the recorded experts and the gate weighs them from its current scores as it
always does, so the router keeps its gradient. A recompute (activation checkpointing) replays the entry of
the layer's oldest forward not yet recomputed, as activation checkpointing runs them, and records nothing.

Both hooks are `torch.library` custom ops, so a compiled layer (fullgraph) takes the recorded indices as a
tensor computed when it runs, and the trace's bookkeeping stays in Python.
"""
import contextlib
import itertools
import json
from typing import Dict, List, Sequence, Union

import torch
from torch import nn

from fmoe.gates.base import BaseGate
from fmoe.gates.tape import TAPES, Tape
from fmoe.layer import FMoE

FORMAT = "fmoe.routing_trace"
VERSION = 1

_keys = itertools.count()


class RoutingTrace:
    """Per MoE layer (qualified name) the expert ids `[T, K]` (int64, -1: no expert) of each forward."""

    def __init__(self, layers: Dict[str, List[torch.Tensor]] = None):
        self.layers = {name: list(entries) for name, entries in (layers or {}).items()}

    @property
    def names(self) -> List[str]:
        return list(self.layers)

    def __getitem__(self, name: str) -> List[torch.Tensor]:
        return self.layers[name]

    def __repr__(self):
        forwards = {name: len(entries) for name, entries in self.layers.items()}
        return f"RoutingTrace({forwards})"

    def save(self, path: str):
        """Writes the trace: safetensors when `path` ends in .safetensors, else torch.save; the format
        name, its version and the layer names go with the indices (int32)."""
        header = {"format": FORMAT, "version": VERSION, "layers": self.names}
        tensors = {f"{i}.{j}": entry.to(torch.int32).contiguous() for i, entries in enumerate(self.layers.values())
                   for j, entry in enumerate(entries)}
        if str(path).endswith(".safetensors"):
            from safetensors.torch import save_file
            header["forwards"] = [len(entries) for entries in self.layers.values()]
            save_file(tensors, str(path), metadata={"fmoe": json.dumps(header)})
        else:
            torch.save({**header, "entries": [[t.to(torch.int32) for t in e] for e in self.layers.values()]}, path)

    @classmethod
    def load(cls, path: str) -> "RoutingTrace":
        """A trace written by `save` (either format)."""
        if str(path).endswith(".safetensors"):
            from safetensors import safe_open
            with safe_open(str(path), framework="pt") as f:
                header = json.loads((f.metadata() or {}).get("fmoe", "{}"))
                check_header(header, path)
                return cls({name: [f.get_tensor(f"{i}.{j}").long() for j in range(n)]
                            for i, (name, n) in enumerate(zip(header["layers"], header["forwards"]))})
        saved = torch.load(path, weights_only=True)
        check_header(saved if isinstance(saved, dict) else {}, path)
        return cls({name: [t.long() for t in entries] for name, entries in zip(saved["layers"], saved["entries"])})

    def split(self, split_size_or_sections: Union[int, Sequence[int]]) -> List["RoutingTrace"]:
        """The trace cut along the tokens, as `torch.split` cuts each entry: one trace per micro-batch
        (gradient accumulation over a rollout recorded in one forward). Tokens are numbered as the
        layer flattens its input ([batch, seq] row-major), so micro-batches of whole sequences are
        contiguous."""
        pieces = {name: [entry.split(split_size_or_sections) for entry in entries]
                  for name, entries in self.layers.items()}
        counts = {len(p) for parts in pieces.values() for p in parts}
        if len(counts) > 1:
            raise ValueError(f"split({split_size_or_sections!r}) cuts the entries into {sorted(counts)} pieces: "
                             "their token counts differ; split a trace whose forwards have the same tokens")
        n = counts.pop() if counts else 0
        return [RoutingTrace({name: [parts[i] for parts in entries] for name, entries in pieces.items()})
                for i in range(n)]


    def joined(self, batch_size: int) -> "RoutingTrace":
        """Generation's forwards (the prompts, then each step's new tokens, `batch_size` sequences each)
        as one forward over the whole sequences: what a training forward on `generate`'s output without
        its last token (which no forward saw) routes."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"joined: batch_size must be a positive int, got {batch_size!r}")
        layers = {}
        for name, entries in self.layers.items():
            odd = [entry.shape[0] for entry in entries if entry.shape[0] % batch_size]
            if odd:
                raise ValueError(f"joined: layer {name!r} has forwards of {odd} tokens, not whole steps of "
                                 f"batch_size={batch_size} sequences")
            steps = [entry.view(batch_size, -1, entry.shape[-1]) for entry in entries]
            layers[name] = [torch.cat(steps, dim=1).flatten(0, 1)] if steps else []
        return RoutingTrace(layers)


def check_header(header: dict, path) -> None:
    if header.get("format") != FORMAT:
        raise ValueError(f"{path} is not an fmoe routing trace (no '{FORMAT}' header)")
    if header.get("version") != VERSION:
        raise ValueError(f"{path} is a routing trace of format version {header.get('version')!r}; this fmoe "
                         f"reads version {VERSION}")


def moe_layers(model: Union[nn.Module, Sequence[nn.Module]]) -> Dict[str, FMoE]:
    """Every MoE layer of `model` (or of a list of model chunks) by the name a trace keys it by: its
    qualified name, or the name the layer gives itself (`routing_name`: Megatron's layers name
    themselves by their global layer number, so each pipeline stage finds its own layers in a whole
    model's trace)."""
    layers = {}
    for chunk in model if isinstance(model, (list, tuple, nn.ModuleList)) else [model]:
        for name, module in chunk.named_modules():
            if isinstance(module, FMoE):
                key = module.routing_name or name
                if key in layers:
                    raise ValueError(f"two MoE layers are named {key!r} (model chunks without global names?): "
                                     "a trace could not tell them apart")
                layers[key] = module
    if not layers:
        raise ValueError(f"{type(model).__name__} has no MoE layer (fmoe.FMoE) to record or replay")
    return layers


def gates_of(layers: Dict[str, FMoE], what: str) -> Dict[str, BaseGate]:
    """Each layer's gate, checked: one fmoe gate (BaseGate) each, free of any record or replay."""
    gates = {}
    for name, layer in layers.items():
        gate = layer.gate
        if not isinstance(gate, BaseGate):
            raise ValueError(f"{what}: layer {name!r} has a {type(gate).__name__} gate; only fmoe gates (BaseGate) "
                             "record and replay their routing")
        if gate.routing_mode is not None:
            raise ValueError(f"{what}: layer {name!r} is already under {gate.routing_mode}_routing: record and replay "
                             "cannot nest on the same model")
        gates[name] = gate
    return gates


@contextlib.contextmanager
def taped(gates: Dict[str, BaseGate], mode: str, entries: Dict[str, List[torch.Tensor]]):
    """Each gate in `mode` ("record" / "replay") with its tape for the duration."""
    for name, gate in gates.items():
        if gate.routing_key is None or gate.routing_key in TAPES:      # a copy of a gate has its key too
            gate.routing_key = next(_keys)
        TAPES[gate.routing_key] = Tape(name, entries[name])
        gate.routing_mode = mode
    try:
        yield
    finally:
        for gate in gates.values():
            gate.routing_mode = gate.replayed_TK = None      # also after a route() that raised
            del TAPES[gate.routing_key]


@contextlib.contextmanager
def record_routing(model: nn.Module):
    """`with fmoe.record_routing(model) as trace:` records, for each MoE layer and each forward inside,
    the experts its gate chose (after capacity and random routing: -1 where a slot reached none)."""
    gates = gates_of(moe_layers(model), "record_routing")
    trace = RoutingTrace({name: [] for name in gates})
    with taped(gates, "record", trace.layers):
        yield trace
    for name, entries in trace.layers.items():
        trace.layers[name] = [entry.cpu() for entry in entries]


@contextlib.contextmanager
def replay_routing(model: nn.Module, trace: RoutingTrace):
    """`with fmoe.replay_routing(model, trace):` each MoE layer's forwards choose the experts of the
    layer's entries in `trace`, in order. The combine weights come from the current router's scores at
    those experts, normalised as the gate normalises them (a -1 slot takes no part and weighs 0), so the
    router keeps its gradient; the balance losses and the load statistics count the replayed choice.
    A capacity never drops a replayed slot and random routing leaves none out: the trace already says
    which slots reached no expert. Everything is checked before any layer changes: the trace must hold
    every layer of the model (it may hold more: other pipeline stages'), with ids in [-1, experts) and
    `top_k` columns; a forward whose token count differs from its entry's, or past the last entry,
    fails naming the layer."""
    if not isinstance(trace, RoutingTrace):
        raise ValueError(f"replay_routing: trace must be a fmoe.RoutingTrace, got {type(trace).__name__}")
    layers = moe_layers(model)
    missing = [name for name in layers if name not in trace.layers]
    if missing:
        raise ValueError(f"replay_routing: the trace has no entries for layers {missing}; it holds {trace.names}")
    gates = gates_of(layers, "replay_routing")
    for name, gate in gates.items():
        if gate.routes_by_forward():
            raise ValueError(f"replay_routing: layer {name!r}'s {type(gate).__name__} routes in its own forward(); "
                             "only a gate routing through route() and BaseGate.choose replays")
        for i, entry in enumerate(trace.layers[name]):
            check_entry(name, i, entry, gate)
    with taped(gates, "replay", {name: trace.layers[name] for name in gates}):
        yield


def check_entry(name: str, i: int, entry: torch.Tensor, gate: BaseGate) -> None:
    where = f"replay_routing: layer {name!r}, forward {i + 1}"
    if not isinstance(entry, torch.Tensor) or entry.dim() != 2 or entry.is_floating_point() or entry.is_complex():
        raise ValueError(f"{where}: an entry must be an integer tensor [tokens, top_k], got "
                         f"{getattr(entry, 'dtype', type(entry).__name__)} {tuple(getattr(entry, 'shape', ()))}")
    if entry.shape[1] != gate.top_k:
        raise ValueError(f"{where}: {entry.shape[1]} experts a token, the gate routes top_k={gate.top_k}")
    if entry.numel() and not (-1 <= int(entry.min()) and int(entry.max()) < gate.tot_expert):
        raise ValueError(f"{where}: expert ids must be in [-1, {gate.tot_expert}) (the layer's experts), "
                         f"got ids from {int(entry.min())} to {int(entry.max())}")
