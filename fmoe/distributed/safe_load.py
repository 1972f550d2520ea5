"""Reading torch.distributed.checkpoint folders without running what the files say.

A DCP folder is pickles: its `.metadata` is one (torch unpickles it with plain `pickle`), and every
non-tensor entry of the state (optimizer param groups, extras) is a `torch.save` blob that DCP's
default planner loads with `weights_only=False`. Either can pickle a call, which plain unpickling
runs. Checkpoints travel between people, so fmoe reads both restrictively:

- `.metadata` with `RestrictedUnpickler`, which admits only the classes DCP writes there (its
  metadata dataclasses and enums, its storage records, torch dtypes, sizes and layouts, paths and
  plain containers) and refuses any other global by name, before any other work;
- non-tensor entries with `torch.load(weights_only=True)` (tensors, numbers, strings, containers).

`read_metadata(path)` and `load(state, path)` are the only ways fmoe reads such a folder.
"""
import io
import os
import pickle
import re
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

METADATA_FILE = ".metadata"

# Modules whose classes DCP's metadata is made of: every class they define may be rebuilt.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")
_PATHS = {("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                                          "PureWindowsPath")}
_PLAIN = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
          ("torch", "Size"), ("torch.serialization", "_get_layout"), ("torch", "device")}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks to rebuild something no checkpoint of its kind holds: refused, not run."""


def _admitted(module: str, name: str) -> bool:
    if (module, name) in _PLAIN or (module, name) in _PATHS:
        return True
    if module == "torch":           # dtypes and memory formats are module attributes of torch
        value = getattr(torch, name, None)
        return isinstance(value, (torch.dtype, torch.memory_format, torch.layout))
    if module in _DCP_MODULES:      # a class defined there (dataclass or enum), never a function
        import importlib
        value = getattr(importlib.import_module(module), name, None)
        return isinstance(value, type) and value.__module__ == module
    return False


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any other global raises `UnsafeCheckpointError` naming the file."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if not _admitted(module, name):
            raise UnsafeCheckpointError(f"{self.where} asks to load the global {module}.{name}, which no "
                                        "checkpoint metadata holds; refused without running it (see the "
                                        "checkpoint threat model in docs/checkpoints.md)")
        return super().find_class(module, name)


def restricted_loads(data: bytes, where: str) -> Any:
    """Unpickle `data` (read from `where`) admitting only what DCP metadata is made of."""
    return RestrictedUnpickler(io.BytesIO(data), where).load()


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader whose metadata is unpickled by `RestrictedUnpickler`."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "rb") as stream:
            metadata = restricted_loads(stream.read(), str(path))
        load_id = getattr(self, "load_id", None)        # torch >= 2.3 stamps each load (StorageMeta)
        if load_id is not None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner with non-tensor entries read as `torch.load(weights_only=True)`."""

    def __init__(self, path: str, **kwargs):
        super().__init__(**kwargs)
        self.path = path

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        loaded = _load_plain(value, f"{self.path}: the entry {fqn!r}")
        if self.flatten_state_dict:         # as DefaultLoadPlanner.load_bytes, with the value read safely
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def read_metadata(path: str):
    """The `.metadata` of the DCP folder `path`, restrictively unpickled."""
    return SafeFileSystemReader(path).read_metadata()


def verify_folder(path: str):
    """Refuse the DCP folder `path` if any of its pickles asks for more than its kind holds; returns
    its metadata. For loaders that are not fmoe's (Megatron-Core's), which unpickle plainly: run it
    before handing them the folder."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_metadata(path)
    for name in sorted(os.listdir(path)):     # torch.save files beside the shards (Megatron's common.pt)
        if name.endswith(".pt"):
            with open(os.path.join(path, name), "rb") as f:
                _load_plain(io.BytesIO(f.read()), os.path.join(path, name))
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        where = f"{os.path.join(path, info.relative_path)}: the entry {index.fqn!r}"
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(f"{where} is stored transformed {info.transform_descriptors}, which "
                                        "fmoe cannot check before loading; refused")
        with open(os.path.join(path, info.relative_path), "rb") as shard:
            shard.seek(info.offset)
            blob = shard.read(info.length)
        _load_plain(io.BytesIO(blob), where)
    return metadata


def _load_plain(blob: io.BytesIO, where: str):
    """torch.load(weights_only=True), refusing with `UnsafeCheckpointError` what it will not rebuild."""
    try:
        return torch.load(blob, weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message is a page of advice; the global it refused is the line that matters here
        named = re.search(r"GLOBAL ([\w.]+)", str(err))
        what = f"the global {named.group(1)}" if named else "more than tensors, numbers, strings and containers"
        raise UnsafeCheckpointError(f"{where} asks to load {what}; refused without running it") from err


def load(state: dict, path: str, no_dist: bool = False) -> None:
    """`dcp.load` of `state` from the folder `path`, reading every pickle restrictively."""
    from torch.distributed.checkpoint.api import CheckpointException

    verify_folder(path)         # refuse a hostile folder before anything is loaded from it
    reader = SafeFileSystemReader(path)
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(path), checkpoint_id=path, no_dist=no_dist)
    except CheckpointException as err:      # DCP gathers each rank's error; a refusal stays a refusal
        refused = [e for e, _ in err.failures.values() if isinstance(e, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from err
        raise
