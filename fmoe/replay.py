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

A trace file carries a SHA-256 of its routing data, and `RoutingTrace.load` checks the file whole: an empty,
truncated or unreadable file, a header field of the wrong type or range, a failed checksum or a bad entry
raises a `TraceFileError` naming the file (and the field, or the layer and forward).
"""
import contextlib
import hashlib
import itertools
import json
import os
import re
from typing import Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from fmoe.gates.base import BaseGate
from fmoe.gates.round_robin import RoundRobinGate
from fmoe.gates.swipe import SwipeGate
from fmoe.gates.tape import TAPES, Tape
from fmoe.gates.zero import ZeroGate
from fmoe.layer import FMoE

FORMAT = "fmoe.routing_trace"
VERSION = 1

_keys = itertools.count()
# The gates that place slots without a top-k and so may send a token to one expert twice: ZeroGate (every
# slot to expert 0), RoundRobinGate (fewer experts than top_k), SwipeGate (a moved slot lands on a fixed expert).
# A gate outside fmoe's core says so by `repeats_experts = True` (the seam's: a family's hash routing).
REPEATING_GATES = (ZeroGate, RoundRobinGate, SwipeGate)


class TraceFileError(ValueError):
    """A routing trace file that is empty, truncated, corrupt or malformed: the message names the file."""


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
        name, its version, the layer names and the SHA-256 of the routing data go with the indices (int32)."""
        int32 = [[entry.to(torch.int32).contiguous() for entry in forwards] for forwards in self.layers.values()]
        header = {"format": FORMAT, "version": VERSION, "layers": self.names,
                  "sha256": routing_digest(self.names, int32)}
        if str(path).endswith(".safetensors"):
            from safetensors.torch import save_file
            header["forwards"] = [len(forwards) for forwards in int32]
            tensors = {f"{i}.{j}": entry for i, forwards in enumerate(int32) for j, entry in enumerate(forwards)}
            save_file(tensors, str(path), metadata={"fmoe": json.dumps(header)})
        else:
            torch.save({**header, "entries": int32}, path)

    @classmethod
    def load(cls, path: str) -> "RoutingTrace":
        """A trace written by `save` (either format), checked whole: a missing, empty, truncated or
        unreadable file, a header field of the wrong type or range, routing data that fails its SHA-256,
        or an entry that is not an integer tensor [tokens, top_k] of ids >= -1 raises a TraceFileError
        naming the file. A trace written before the checksum was stored (no `sha256` in its header) loads
        with every other check but without the checksum's."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"no routing trace at {path}")
        if os.path.getsize(path) == 0:
            raise TraceFileError(f"routing trace {path} is empty (0 bytes)")
        read = read_safetensors_trace if str(path).endswith(".safetensors") else read_torch_trace
        names, entries, digest = read(path)
        check_loaded_entries(path, names, entries, digest)
        return cls({name: [entry.long() for entry in forwards] for name, forwards in zip(names, entries)})

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


def check_loaded_entries(path, names: List[str], entries: List[List[torch.Tensor]], digest: Optional[str]):
    """A file's entries: integer tensors [tokens, top_k], then their SHA-256 (when the file has one), then
    ids >= -1 (the experts' count is the model's: replay_routing checks the ids against it)."""
    def where(name, j):
        return f"routing trace {path}: layer {name!r}, forward {j + 1}"

    for name, forwards in zip(names, entries):
        for j, entry in enumerate(forwards):
            problem = entry_problem(entry)
            if problem:
                raise TraceFileError(f"{where(name, j)}: {problem}")
    if digest is not None and routing_digest(names, entries) != digest:
        raise TraceFileError(f"routing trace {path} is corrupt: its routing data fails the SHA-256 its header records")
    for name, forwards in zip(names, entries):
        for j, entry in enumerate(forwards):
            if entry.numel() and int(entry.min()) < -1:
                raise TraceFileError(f"{where(name, j)}: expert ids must be >= -1, got {int(entry.min())}")


def routing_digest(names: Sequence[str], entries: Sequence[Sequence[torch.Tensor]]) -> str:
    """SHA-256 over a trace's routing data: each layer's name and forward count, then each forward's
    shape and ids (int32, little-endian), in order."""
    digest = hashlib.sha256()
    for name, forwards in zip(names, entries):
        digest.update(json.dumps([name, len(forwards)]).encode())
        for entry in forwards:
            ids = entry.detach().cpu().to(torch.int32).contiguous()
            digest.update(json.dumps(list(ids.shape)).encode())
            digest.update(ids.numpy().astype("<i4").tobytes())
    return digest.hexdigest()


def read_safetensors_trace(path):
    """(layer names, their entries, the recorded SHA-256 or None) of a .safetensors trace, its header checked."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:        # a header too small, offsets past the end: all a truncated or corrupt file
        raise unreadable(path, "safetensors", err) from err
    if "fmoe" not in metadata:
        raise TraceFileError(f"{path} is not an fmoe routing trace (no '{FORMAT}' header)")
    try:
        header = json.loads(metadata["fmoe"])
    except ValueError as err:
        raise unreadable(path, "json (its 'fmoe' metadata)", err) from err
    names = check_header(header, path)
    forwards = header_field(header, path, "forwards", f"a list of {len(names)} ints >= 0 (each layer's forwards)",
                            lambda v: isinstance(v, list) and len(v) == len(names)
                            and all(is_int(n) and n >= 0 for n in v))
    keys = [[f"{i}.{j}" for j in range(n)] for i, n in enumerate(forwards)]
    for name, layer_keys in zip(names, keys):
        for j, key in enumerate(layer_keys):
            if key not in tensors:
                raise TraceFileError(f"routing trace {path} has no tensor {key!r} (layer {name!r}, forward {j + 1}) "
                                     "though its header's 'forwards' lists it")
    extra = sorted(set(tensors) - {key for layer_keys in keys for key in layer_keys})
    if extra:
        raise TraceFileError(f"routing trace {path} holds tensors {extra} that its header's 'forwards' does not list")
    return names, [[tensors[key] for key in layer_keys] for layer_keys in keys], header.get("sha256")


def read_torch_trace(path):
    """(layer names, their entries, the recorded SHA-256 or None) of a torch.save trace, its header checked."""
    try:
        saved = torch.load(path, weights_only=True)
    except Exception as err:        # zip, pickle and EOF errors all mean a truncated or corrupt file here
        raise unreadable(path, "torch.load", err) from err
    names = check_header(saved, path)
    entries = header_field(saved, path, "entries", f"a list of {len(names)} lists of tensors (each layer's forwards)",
                           lambda v: isinstance(v, list) and len(v) == len(names) and all(
                               isinstance(f, list) and all(isinstance(t, torch.Tensor) for t in f) for f in v))
    return names, entries, saved.get("sha256")


def unreadable(path, reader: str, err: BaseException) -> TraceFileError:
    """The error for a file that `reader` cannot parse: the file, and the first line of the reader's error."""
    first_line = (str(err).splitlines() or [type(err).__name__])[0]
    return TraceFileError(f"routing trace {path} is truncated or corrupt: {reader} cannot read it "
                          f"({type(err).__name__}: {first_line[:200]})")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def header_field(header: dict, path, field: str, expected: str, valid):
    """`header[field]` if `valid` holds for it; else one line naming the file, the field and `expected`."""
    if field not in header:
        raise TraceFileError(f"routing trace {path}: its header has no field '{field}' ({expected})")
    value = header[field]
    if not valid(value):
        raise TraceFileError(f"routing trace {path}: header field '{field}' must be {expected}, got {described(value)}")
    return value


def described(value) -> str:
    """`value` in one short line: a tensor by its dtype and shape, a list item by item."""
    if isinstance(value, torch.Tensor):
        text = f"tensor({value.dtype}, {tuple(value.shape)})"
    elif isinstance(value, list):
        text = "[" + ", ".join(described(item) for item in value) + "]"
    else:
        text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."


def check_header(header, path) -> List[str]:
    """The layer names of a trace header whose format, version, layers and checksum fields hold."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TraceFileError(f"{path} is not an fmoe routing trace (no '{FORMAT}' header)")
    version = header_field(header, path, "version", f"the int {VERSION}", is_int)
    if version != VERSION:
        raise TraceFileError(f"{path} is a routing trace of format version {version!r}; this fmoe reads version "
                             f"{VERSION}")
    names = header_field(header, path, "layers", "a list of distinct layer names (str)",
                         lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v)
                         and len(set(v)) == len(v))
    if "sha256" in header:
        header_field(header, path, "sha256", "a SHA-256 digest (64 lowercase hex digits)",
                     lambda v: isinstance(v, str) and re.fullmatch("[0-9a-f]{64}", v) is not None)
    return names


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
    every layer of the model (it may hold more: other pipeline stages'), with ids in [-1, experts),
    `top_k` columns and no token naming one expert in two slots (which only the gates of
    `REPEATING_GATES` do); a forward whose token count differs from its entry's, or past the last entry,
    fails naming the layer.

    A layer converted at the experts seam (`fmoe.integrations.hf.convert(model, seam=True)`) is routed by
    its family's router, which fmoe does not own: there the router's own top-k over its [tokens,
    experts] scores returns the recorded experts, and the router weighs them by its own code
    (`fmoe.integrations.hf.seam.ReplayedTopK` says how, and what a router without such a top-k does)."""
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


def entry_problem(entry) -> Optional[str]:
    """What makes `entry` no trace entry (an integer tensor [tokens, top_k]), or None."""
    if not isinstance(entry, torch.Tensor) or entry.dim() != 2 or entry.dtype == torch.bool \
            or entry.is_floating_point() or entry.is_complex():
        return (f"an entry must be an integer tensor [tokens, top_k], got "
                f"{getattr(entry, 'dtype', type(entry).__name__)} {tuple(getattr(entry, 'shape', ()))}")
    return None


def first_repeating_token(entry_TK: torch.Tensor) -> Optional[int]:
    """The first token whose slots name one expert twice (-1 slots aside), or None."""
    sorted_TK = entry_TK.sort(dim=1).values
    repeats_T = ((sorted_TK[:, 1:] == sorted_TK[:, :-1]) & (sorted_TK[:, 1:] >= 0)).any(dim=1)
    return int(repeats_T.nonzero()[0, 0]) if bool(repeats_T.any()) else None


def check_entry(name: str, i: int, entry: torch.Tensor, gate: BaseGate) -> None:
    where = f"replay_routing: layer {name!r}, forward {i + 1}"
    problem = entry_problem(entry)
    if problem:
        raise ValueError(f"{where}: {problem}")
    if entry.shape[1] != gate.top_k:
        raise ValueError(f"{where}: {entry.shape[1]} experts a token, the gate routes top_k={gate.top_k}")
    if entry.numel() and not (-1 <= int(entry.min()) and int(entry.max()) < gate.tot_expert):
        raise ValueError(f"{where}: expert ids must be in [-1, {gate.tot_expert}) (the layer's experts), "
                         f"got ids from {int(entry.min())} to {int(entry.max())}")
    repeats = isinstance(gate, REPEATING_GATES) or getattr(gate, "repeats_experts", False)
    token = None if repeats else first_repeating_token(entry)
    if token is not None:
        raise ValueError(f"{where}: token {token} (counting from 0) names an expert in two slots, "
                         f"{entry[token].tolist()}; its {type(gate).__name__} sends a token to an expert at most "
                         "once, so the trace is corrupt or was built otherwise")
