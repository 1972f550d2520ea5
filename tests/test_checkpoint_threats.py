"""Hostile checkpoints: a file that pickles a call is refused by every loader before anything runs it.

Each hostile pickle would create a marker file when unpickled plainly; every test asserts the marker never
appears, and that the refusal is one error naming the file and the global it asked for."""
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from fmoe.app import checkpoints
from fmoe.app.cli import main
from fmoe.app.files import save_torch
from fmoe.distributed import safe_load
from fmoe.distributed.checkpoint import load_checkpoint, save_checkpoint
from fmoe.distributed.safe_load import UnsafeCheckpointError
from tests.test_convert import Block
from tests.test_fault_convert import fails_in_one_line
from tests.test_fault_train import TINY


class Payload:
    """Unpickled plainly, it runs `exec`, which writes the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def hostile(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker), protocol=2, fix_imports=False)


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(Block("gelu", "naive"), Block("swiglu", "noisy"))
    optimizer = torch.optim.Adam(model.parameters())
    sum(p.sum() for p in model.parameters()).backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An fmoe sharded checkpoint with optimizer states and param groups (a pickled entry)."""
    folder = tmp_path_factory.mktemp("threats") / "ckpt"
    model, optimizer = model_and_optimizer()
    save_checkpoint(str(folder), model, optimizer, extra={"step": 3})
    return folder


def with_hostile_metadata(src: Path, dst: Path, marker: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / ".metadata").write_bytes(hostile(marker))
    return dst


def with_hostile_entry(src: Path, dst: Path, marker: Path, fqn: str) -> Path:
    """The entry `fqn` (stored as a pickle) replaced by a hostile one appended to its shard; the .metadata,
    rewritten to point at it, stays an honest DCP metadata."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    shutil.copytree(src, dst)
    metadata = safe_load.read_metadata(str(dst))
    index = MetadataIndex(fqn)
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
    shard = dst / info.relative_path
    blob = hostile(marker)
    info.offset, info.length = shard.stat().st_size, len(blob)
    with open(shard, "ab") as f:
        f.write(blob)
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != fqn}
    metadata.storage_data[index] = info
    (dst / ".metadata").write_bytes(pickle.dumps(metadata))
    return dst


def refused(err: str, path: Path, marker: Path, what: str = "builtins.exec"):
    assert str(path) in err and what in err and "refused" in err, err
    assert not marker.exists(), "the hostile pickle ran"


def test_hostile_metadata_is_refused_by_load_checkpoint(saved, tmp_path):
    marker = tmp_path / "ran"
    folder = with_hostile_metadata(saved, tmp_path / "ckpt", marker)
    model, optimizer = model_and_optimizer()
    with pytest.raises(UnsafeCheckpointError) as info:
        load_checkpoint(str(folder), model, optimizer)
    refused(str(info.value), folder / ".metadata", marker)


def test_hostile_pickled_entry_is_refused_by_load_checkpoint(saved, tmp_path):
    marker = tmp_path / "ran"
    folder = with_hostile_entry(saved, tmp_path / "ckpt", marker, "optim/param_groups.0.lr")
    model, optimizer = model_and_optimizer()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UnsafeCheckpointError) as info:
        load_checkpoint(str(folder), model, optimizer)
    refused(str(info.value), folder / "__0_0.distcp", marker, "optim/param_groups.0.lr")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), "refused, yet the model changed"


def test_hostile_entry_is_refused_by_verify_folder_before_another_loader_reads_it(saved, tmp_path):
    marker = tmp_path / "ran"
    folder = with_hostile_entry(saved, tmp_path / "ckpt", marker, "extra/step")
    with pytest.raises(UnsafeCheckpointError) as info:
        safe_load.verify_folder(str(folder))
    refused(str(info.value), folder / "__0_0.distcp", marker, "extra/step")


@pytest.mark.parametrize("to", ["hf", "megatron"])
def test_hostile_metadata_is_refused_by_fmoe_convert_in_one_line(saved, tmp_path, capsys, to):
    marker = tmp_path / "ran"
    src = with_hostile_metadata(saved, tmp_path / "ckpt", marker)
    err = fails_in_one_line(capsys, src, tmp_path / "out", "--to", to)
    refused(err, src / ".metadata", marker)
    assert "corrupt" not in err, "a refusal is not a damaged file"
    assert not (tmp_path / "out").exists()


def test_honest_checkpoints_still_round_trip(saved, tmp_path):
    model, optimizer = model_and_optimizer()
    for p in model.parameters():
        p.data.zero_()
    extra = load_checkpoint(str(saved), model, optimizer, extra_keys=("step",))
    reference, _ = model_and_optimizer()
    assert extra == {"step": 3}
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)


def step_folder_from_a_one_process_run(corpus: Path, root: Path) -> Path:
    """A `fmoe train` step folder (as `--nproc` runs save) made from a one-process run's checkpoint."""
    from fmoe.app.gpt import GPT, GPTConfig

    out = root / "run"
    assert main(["train", *TINY, "--steps", "1", "--data", str(corpus), "--out", str(out), "--no-progress"]) == 0
    state = checkpoints.load_file(out / "checkpoint.pt")
    model = GPT(GPTConfig(**state["model_config"]))
    model.load_state_dict(state["model"])
    folder = checkpoints.new_step_folder(out / "checkpoint", state["step"])
    save_checkpoint(str(folder), model)
    save_torch(folder / checkpoints.TRAINER_FILE, {k: state[k] for k in ("model_config", "train_config", "step",
                                                                         "history")})
    checkpoints.write_manifest(folder, state["step"], {"world_size": 1, "ep_size": 1})
    checkpoints.publish(out / "checkpoint", folder, keep=2)
    (out / "checkpoint.pt").unlink()
    return folder


def test_train_resume_refuses_a_hostile_metadata_whose_manifest_checksum_was_updated(tmp_path, capsys):
    """The manifest is a checksum anybody can recompute: only the restricted unpickler stops the pickle."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(100)))
    folder = step_folder_from_a_one_process_run(corpus, tmp_path)
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(hostile(marker))
    manifest = json.loads((folder / checkpoints.MANIFEST).read_text())
    checkpoints.write_manifest(folder, manifest["step"], {"world_size": 1, "ep_size": 1})
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *TINY, "--steps", "3", "--data", str(corpus), "--out", str(tmp_path / "run"),
              "--no-progress", "--resume"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err, err
    refused(err, folder / ".metadata", marker)


def test_hostile_metadata_is_refused_by_fsdp_load_checkpoint(saved, tmp_path):
    from fmoe.distributed import fsdp

    marker = tmp_path / "ran"
    folder = with_hostile_metadata(saved, tmp_path / "ckpt", marker)
    with pytest.raises(UnsafeCheckpointError) as info:
        fsdp.load_checkpoint(str(folder), model=None)       # refused before the model is looked at
    refused(str(info.value), folder / ".metadata", marker)


@pytest.mark.parametrize("damage", [".metadata", "common.pt", "entry"])
def test_hostile_folder_is_refused_before_megatron_core_loads_it(saved, tmp_path, damage):
    """Megatron-Core's dist_checkpointing unpickles .metadata, its entries and common.pt plainly: fmoe's
    Megatron loader checks the folder first."""
    pytest.importorskip("megatron.core")
    from fmoe.integrations.megatron import training

    marker = tmp_path / "ran"
    iteration = tmp_path / "mcore" / "iter_0000003"
    iteration.parent.mkdir()
    if damage == "entry":
        with_hostile_entry(saved, iteration, marker, "extra/step")
        bad = iteration / "__0_0.distcp"
    else:
        shutil.copytree(saved, iteration)
        save_torch(iteration / "common.pt", {"iteration": 3})
        (iteration / damage).write_bytes(hostile(marker))
        bad = iteration / damage
    (iteration.parent / training.LATEST).write_text("3")
    with pytest.raises(UnsafeCheckpointError) as info:
        training.load_checkpoint(str(iteration.parent), model=None)
    refused(str(info.value), bad, marker, "exec")
