"""Faults in `fmoe convert`: missing and damaged sources, flipped bytes, an existing DST, a full disk.
Every failure is one line naming the file and the fault, and leaves DST as it was."""
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fmoe.integrations.hf
from fmoe.app import checkpoints, files
from fmoe.app.cli import main
from fmoe.app.convert import LATEST, MEGATRON_FILE, convert
from fmoe.app.files import save_torch
from fmoe.distributed.checkpoint import save_checkpoint
from tests.fs_utils import in_user_namespace, needs_tmpfs
from tests.hf_models import tiny
from tests.test_convert import Block, model_tensors
from tests.test_fault_train import FullDisk


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """An fmoe checkpoint, the same at Megatron EP 4, a `fmoe train` step folder (with its manifest of
    checksums) and an HF model folder."""
    root = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    model = nn.Sequential(Block("gelu", "naive"), Block("swiglu", "noisy"))
    save_checkpoint(str(root / "fmoe"), model)
    convert(str(root / "fmoe"), str(root / "mcore"), "megatron", ep_size=4)
    step = root / "run" / "checkpoint" / "step-00000002"
    step.mkdir(parents=True)
    save_checkpoint(str(step), model)
    save_torch(step / "trainer.pt", {"step": 2})
    checkpoints.write_manifest(step, 2, {"world_size": 2, "ep_size": 2})
    fmoe.integrations.hf.export(fmoe.integrations.hf.convert(tiny("qwen3_moe")), root / "hf")
    return root


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def fails_in_one_line(capsys, *argv) -> str:
    """`fmoe convert ARGV` exits 2 with a single line on stderr; returns it."""
    capsys.readouterr()     # what earlier calls printed (transformers' loading bars) is not this command's
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", *map(str, argv)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fmoe convert: error: ") and "\n" not in err, err
    return err


def tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# --- Megatron sources -------------------------------------------------------------------------------

@pytest.mark.parametrize("missing", ["000", "003", "001"])
def test_a_missing_expert_parallel_rank_folder_is_an_error_naming_it(sources, tmp_path, capsys, missing):
    src = copy(sources / "mcore", tmp_path / "mcore")
    shutil.rmtree(src / "iter_0000000" / f"mp_rank_00_{missing}")
    err = fails_in_one_line(capsys, src, tmp_path / "out", "--to", "fmoe")
    assert f"mp_rank_00_{missing}" in err and "missing" in err, err
    assert not (tmp_path / "out").exists()


def test_megatron_release_iteration_reads_its_release_folder(sources, tmp_path):
    src = copy(sources / "mcore", tmp_path / "mcore")
    (src / "iter_0000000").rename(src / "release")
    (src / LATEST).write_text("release\n")
    convert(str(src), str(tmp_path / "back"), "fmoe")
    assert model_tensors(str(tmp_path / "back")).keys() == model_tensors(str(sources / "fmoe")).keys()


def test_megatron_latest_iteration_that_is_no_number_names_the_file(sources, tmp_path, capsys):
    src = copy(sources / "mcore", tmp_path / "mcore")
    (src / LATEST).write_text("seven")
    err = fails_in_one_line(capsys, src, tmp_path / "out", "--to", "fmoe")
    assert str(src / LATEST) in err and "'seven'" in err and "release" in err, err


# --- damaged sources --------------------------------------------------------------------------------

def truncate(path: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("layout,damaged", [
    ("fmoe", ".metadata"),
    ("fmoe", "__0_0.distcp"),
    ("hf", "model.safetensors"),
    ("mcore", f"iter_0000000/mp_rank_00_002/{MEGATRON_FILE}"),
])
def test_a_truncated_source_file_is_one_line_naming_it(sources, tmp_path, capsys, layout, damaged):
    src = copy(sources / layout, tmp_path / layout)
    truncate(src / damaged)
    err = fails_in_one_line(capsys, src, tmp_path / "out", "--to", "megatron" if layout != "mcore" else "fmoe")
    assert str(src / damaged) in err and "truncated" in err, err
    assert not (tmp_path / "out").exists()


def test_flipped_bytes_in_a_train_checkpoint_fail_its_checksum(sources, tmp_path, capsys):
    """64 flipped bytes in an expert tensor: the manifest that `fmoe train --resume` checks refuses them."""
    step = copy(sources / "run", tmp_path / "run") / "checkpoint" / "step-00000002"
    assert convert(str(step), str(tmp_path / "good"), "megatron")["expert_tensors"] == 2 * 4 * 4
    shard = step / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    expert = model_tensors(str(step))["model/1.moe.experts.w1_eDF@expert3"].numpy().tobytes()
    at = data.find(expert)
    data[at:at + 64] = bytes(b ^ 0xFF for b in data[at:at + 64])
    shard.write_bytes(bytes(data))
    err = fails_in_one_line(capsys, step, tmp_path / "out", "--to", "megatron")
    assert f"{shard} is corrupt" in err and "checksum" in err, err
    with pytest.raises(checkpoints.CheckpointError, match="checksum does not match"):
        checkpoints.load_folder(step.parent, step)         # what --resume says of the same folder
    assert not (tmp_path / "out").exists()


def test_a_flipped_byte_in_a_megatron_rank_file_fails_its_zip_crc(sources, tmp_path, capsys):
    """One flipped byte in an expert weight: torch.load reads it unchecked; the zip record's CRC-32 does not."""
    src = copy(sources / "mcore", tmp_path / "mcore")
    rank_file = src / "iter_0000000" / "mp_rank_00_001" / MEGATRON_FILE
    state = torch.load(rank_file, weights_only=True)["model"]
    expert = next(t for k, t in state.items() if ".experts.local_experts." in k and k.endswith("linear_fc1.weight"))
    data = bytearray(rank_file.read_bytes())
    at = data.find(expert.numpy().tobytes())
    assert at > 0
    data[at + 5] ^= 0x01
    rank_file.write_bytes(bytes(data))
    err = fails_in_one_line(capsys, src, tmp_path / "out", "--to", "fmoe")
    assert str(rank_file) in err and "CRC-32" in err and "/data/" in err, err
    assert not (tmp_path / "out").exists()


# --- bad arguments ----------------------------------------------------------------------------------

@pytest.mark.parametrize("to", ["fmoe", "hf"])
@pytest.mark.parametrize("option", [["--pp-size", "2"], ["--ep-size", "2"], ["--expert-layout", "grouped"]])
def test_megatron_options_are_refused_for_other_layouts(sources, tmp_path, capsys, to, option):
    err = fails_in_one_line(capsys, sources / "fmoe", tmp_path / "out", "--to", to, *option)
    assert f"{' '.join(option)} lays out Megatron checkpoints" in err and f"--to {to}" in err, err
    assert not (tmp_path / "out").exists()


def test_a_missing_hf_config_folder_is_named(sources, tmp_path, capsys):
    err = fails_in_one_line(capsys, sources / "fmoe", tmp_path / "out", "--to", "hf", "--hf-config",
                            tmp_path / "nonexistent")
    assert f"--hf-config {tmp_path / 'nonexistent'}: no such folder" in err, err
    (tmp_path / "empty").mkdir()
    err = fails_in_one_line(capsys, sources / "fmoe", tmp_path / "out", "--to", "hf", "--hf-config", tmp_path / "empty")
    assert f"--hf-config {tmp_path / 'empty'}: the folder holds no config.json" in err, err
    assert not (tmp_path / "out").exists()


# --- an existing DST ------------------------------------------------------------------------------

def test_an_existing_dst_is_refused_unless_overwrite_which_replaces_it_whole(sources, tmp_path, capsys):
    dst = tmp_path / "dst"
    convert(str(sources / "hf"), str(dst), "fmoe")          # an fmoe checkpoint with its config.json
    before = tree(dst)
    err = fails_in_one_line(capsys, sources / "mcore", dst, "--to", "fmoe")
    assert str(dst) in err and "--overwrite" in err, err
    assert tree(dst) == before
    assert main(["convert", str(sources / "mcore"), str(dst), "--to", "fmoe", "--overwrite"]) == 0
    assert not (dst / "config.json").exists(), "the old checkpoint's config.json must go with it"
    assert model_tensors(str(dst)).keys() == model_tensors(str(sources / "fmoe")).keys()
    # Megatron EP 4 rewritten at EP 1: one layout, no rank folder of the old one left.
    mcore = copy(sources / "mcore", tmp_path / "mcore")
    assert main(["convert", str(dst), str(mcore), "--to", "megatron", "--overwrite"]) == 0
    assert sorted(p.name for p in (mcore / "iter_0000000").iterdir()) == ["mp_rank_00"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "mcore"], "no staging folder left"


def test_an_empty_dst_folder_is_used(sources, tmp_path):
    (tmp_path / "dst").mkdir()
    convert(str(sources / "fmoe"), str(tmp_path / "dst"), "megatron")
    assert (tmp_path / "dst" / LATEST).exists()


def test_a_failed_overwrite_leaves_dst_as_it_was(sources, tmp_path, capsys):
    dst = copy(sources / "mcore", tmp_path / "dst")
    before = tree(dst)
    err = fails_in_one_line(capsys, sources / "fmoe", dst, "--to", "megatron", "--ep-size", "3", "--overwrite")
    assert "--ep-size 3" in err
    err = fails_in_one_line(capsys, sources / "fmoe", dst, "--to", "hf", "--overwrite")
    assert "--hf-config" in err
    assert tree(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_overwrite_never_removes_the_source(sources, tmp_path, capsys):
    inner = copy(sources / "fmoe", tmp_path / "outer" / "fmoe")
    err = fails_in_one_line(capsys, inner, tmp_path / "outer", "--to", "megatron", "--overwrite")
    assert "SRC" in err and "inside DST" in err, err
    assert inner.is_dir()


# --- a full disk ------------------------------------------------------------------------------------

def test_a_full_disk_is_one_line_and_leaves_no_partial_file(sources, tmp_path, monkeypatch, capsys):
    """ENOSPC injected into fmoe's file writes: the rank files of a Megatron checkpoint."""
    dst = copy(sources / "fmoe", tmp_path / "dst")
    before = tree(dst)
    real_fdopen = os.fdopen
    monkeypatch.setattr(files.os, "fdopen", lambda fd, mode: FullDisk(real_fdopen(fd, mode), room=4000))
    err = fails_in_one_line(capsys, sources / "fmoe", dst, "--to", "megatron", "--overwrite")
    assert str(dst) in err and "disk full (ENOSPC)" in err and "unchanged" in err, err
    assert tree(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


@needs_tmpfs
@pytest.mark.parametrize("source,to", [("fmoe", "megatron"), ("mcore", "fmoe"), ("hf_fmoe", "hf")])
def test_a_really_full_disk_is_one_line_and_leaves_dst_as_it_was(sources, tmp_path, source, to):
    """A 16 KiB tmpfs (mounted in a user namespace) holding DST: torch's zip writer, torch.distributed.checkpoint
    and safetensors each run out of space."""
    if source == "hf_fmoe" and not (sources / source).exists():
        convert(str(sources / "hf"), str(sources / source), "fmoe")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (f"mount -t tmpfs -o size=16k tmpfs {disk} && mkdir {disk}/dst && echo old > {disk}/dst/kept && "
              f"{sys.executable} -m fmoe.app.cli convert {sources / source} {disk}/dst --to {to} --overwrite; "
              f"echo status=$?; ls -A {disk}; cat {disk}/dst/kept")
    result = in_user_namespace(script)
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "fmoe convert: error: " in result.stderr and f"{disk}/dst" in result.stderr
    assert "disk full (ENOSPC)" in result.stderr, result.stderr
    assert result.stdout.split() == ["status=2", "dst", "old"], result.stdout
