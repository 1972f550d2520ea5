"""fmoe convert --to hf / from HF: exact round trips through HF's own layout (Qwen3-MoE, Qwen2-MoE with its
shared expert, gpt-oss), nothing dropped, and a checkpoint written by a real 2-rank expert-parallel run
through Megatron's layout and back."""
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import fmoe.integrations.hf
from fmoe.app.cli import main
from fmoe.app.convert import convert, single_process
from fmoe.distributed.checkpoint import load_checkpoint, save_checkpoint
from tests.dist_utils import run_ranks
from tests.hf_models import tiny, tokens
from tests.test_convert import model_tensors


def hf_tensors(path):
    return load_file(str(path / "model.safetensors"))


def assert_same(before: dict, after: dict):
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "gpt_oss"])
def hf_model(request, tmp_path_factory):
    """A tiny HF model folder in its family's layout, as fmoe.integrations.hf.export writes it."""
    path = tmp_path_factory.mktemp(request.param) / "hf"
    fmoe.integrations.hf.export(fmoe.integrations.hf.convert(tiny(request.param)), path)
    return request.param, path


def test_hf_round_trips_through_fmoe_and_megatron_exactly(hf_model, tmp_path):
    family, hf = hf_model
    counts = convert(str(hf), str(tmp_path / "fmoe"), "fmoe")
    per_expert = 4 if family == "gpt_oss" else 2          # w1, w2 (and b1, b2)
    assert counts["expert_tensors"] == 2 * 4 * per_expert and counts["layers"] == 2
    # The fmoe checkpoint carries the HF config, so neither step back needs --hf-config.
    convert(str(tmp_path / "fmoe"), str(tmp_path / "mcore"), "megatron", ep_size=2)
    convert(str(tmp_path / "mcore"), str(tmp_path / "back"), "hf")
    assert_same(hf_tensors(hf), hf_tensors(tmp_path / "back"))
    # What HF -> fmoe wrote loads into the converted model at EP 1 and computes the same.
    model = fmoe.integrations.hf.convert(tiny(family, seed=5))
    load_checkpoint(str(tmp_path / "fmoe"), model)
    ids = tokens()
    assert torch.equal(model(ids).logits, fmoe.integrations.hf.convert(tiny(family))(ids).logits)


def test_fmoe_round_trips_through_hf_exactly(hf_model, tmp_path):
    family, hf = hf_model
    model = fmoe.integrations.hf.convert(tiny(family, seed=3))
    save_checkpoint(str(tmp_path / "fmoe"), model)
    assert main(["convert", str(tmp_path / "fmoe"), str(tmp_path / "hf"), "--to", "hf", "--hf-config", str(hf)]) == 0
    convert(str(tmp_path / "hf"), str(tmp_path / "back"), "fmoe")
    assert_same(model_tensors(str(tmp_path / "fmoe")), model_tensors(str(tmp_path / "back")))


def test_a_missing_expert_tensor_is_an_error(hf_model, tmp_path):
    family, hf = hf_model
    state = hf_tensors(hf)
    del state["model.layers.1.mlp.experts.down_proj"]
    (tmp_path / "partial").mkdir()
    save_file(state, str(tmp_path / "partial" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "partial" / "config.json").write_text((hf / "config.json").read_text())
    with pytest.raises(ValueError, match=r"missing_keys: \['model.layers.1.mlp.experts.down_proj'\]"):
        convert(str(tmp_path / "partial"), str(tmp_path / "x"), "fmoe")
    convert(str(hf), str(tmp_path / "fmoe"), "fmoe")
    state = model_tensors(str(tmp_path / "fmoe"))
    del state["model/model.layers.0.mlp.moe.experts.w2_eFD@expert2"]
    with single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "partial_fmoe")), no_dist=True)
    with pytest.raises(ValueError, match=r"has 4 experts but no w2_eFD for expert\(s\) \[2\]"):
        convert(str(tmp_path / "partial_fmoe"), str(tmp_path / "y"), "hf", hf_config=str(hf))


def test_to_hf_needs_the_hf_config(tmp_path):
    model = fmoe.integrations.hf.convert(tiny("qwen3_moe"))
    save_checkpoint(str(tmp_path / "fmoe"), model)
    with pytest.raises(ValueError, match="--to hf needs the model's HF config: pass --hf-config"):
        convert(str(tmp_path / "fmoe"), str(tmp_path / "hf"), "hf")


def save_from_two_ranks(rank, world, path):
    model = fmoe.integrations.hf.convert(tiny("qwen3_moe"), ep_size=2)  # each rank holds 2 of every layer's 4 experts
    save_checkpoint(path, model)


def test_a_two_rank_expert_parallel_checkpoint_converts_to_megatron_and_back(tmp_path):
    src = str(tmp_path / "ep2")
    run_ranks(save_from_two_ranks, 2, src)
    for ep_size in (1, 4):
        convert(src, str(tmp_path / f"mcore{ep_size}"), "megatron", ep_size=ep_size)
        convert(str(tmp_path / f"mcore{ep_size}"), str(tmp_path / f"back{ep_size}"), "fmoe")
        assert_same(model_tensors(src), model_tensors(str(tmp_path / f"back{ep_size}")))
    # And to HF: the same tensors as the single-process model's export.
    hf = tmp_path / "hf"
    fmoe.integrations.hf.export(fmoe.integrations.hf.convert(tiny("qwen3_moe")), hf)
    convert(src, str(tmp_path / "from_ep2"), "hf", hf_config=str(hf))
    assert_same(hf_tensors(hf), hf_tensors(tmp_path / "from_ep2"))
