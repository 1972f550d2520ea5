"""fmoe convert: fmoe <-> Megatron-Core checkpoints, exact round trips at EP 1, 2 and 4 (and pipeline-sharded
at PP 2 and 4), nothing dropped."""
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import fmoe
from fmoe.app.cli import main
from fmoe.app.convert import MEGATRON_FILE, convert, read, single_process
from fmoe.distributed.checkpoint import save_checkpoint

D, H, EXPERTS = 8, 12, 4


class Block(nn.Module):
    def __init__(self, activation, gate):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.moe = fmoe.FMoETransformerMLP(num_expert=EXPERTS, d_model=D, d_hidden=H, activation=activation, gate=gate)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """An fmoe checkpoint (two MoE layers: gelu with the naive gate, swiglu with the noisy one) and an
    optimizer state, which is not converted."""
    torch.manual_seed(0)
    model = nn.Sequential(Block("gelu", "naive"), Block("swiglu", "noisy"))
    opt = torch.optim.Adam(model.parameters())
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    path = str(tmp_path_factory.mktemp("convert") / "fmoe")
    save_checkpoint(path, model, opt)
    return path, model


def model_tensors(path):
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith("model/")}
    with single_process():
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


@pytest.mark.parametrize("ep_size", [1, 2, 4])
@pytest.mark.parametrize("layout", ["sequential", "grouped"])
def test_round_trip_through_megatron_is_exact(source, tmp_path, ep_size, layout):
    src, model = source
    counts = convert(src, str(tmp_path / "mcore"), "megatron", ep_size, layout)
    assert counts["expert_tensors"] == 2 * 4 * EXPERTS and counts["layers"] == 2 and counts["not_converted"] > 0
    convert(str(tmp_path / "mcore"), str(tmp_path / "back"), "fmoe")
    before, after = model_tensors(src), model_tensors(str(tmp_path / "back"))
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_megatron_layout_names_and_orientation(source, tmp_path):
    src, model = source
    assert main(["convert", src, str(tmp_path / "mcore"), "--to", "megatron", "--ep-size", "2"]) == 0
    rank1 = torch.load(tmp_path / "mcore" / "iter_0000000" / "mp_rank_00_001" / MEGATRON_FILE)["model"]
    experts = model[1].moe.experts
    # Expert 3 is rank 1's local expert 1; Megatron stores fc1 as [F (x2 for swiglu), D], fc2 as [D, F].
    assert torch.equal(rank1["1.experts.local_experts.1.linear_fc1.weight"], experts.w1_eDF[3].detach().t())
    assert torch.equal(rank1["1.experts.local_experts.1.linear_fc2.weight"], experts.w2_eFD[3].detach().t())
    assert torch.equal(rank1["0.router.weight"], model[0].moe.gate.gate.proj.weight.detach())
    assert "1.router.fmoe_gate.w_noise" in rank1 and "0.norm.weight" in rank1
    assert not any("local_experts.2." in k for k in rank1), "local ids run 0..1 on each of 2 ranks"


def test_a_missing_expert_tensor_is_an_error(source, tmp_path):
    src, _ = source
    convert(src, str(tmp_path / "mcore"), "megatron", 2)
    path = tmp_path / "mcore" / "iter_0000000" / "mp_rank_00_001" / MEGATRON_FILE
    saved = torch.load(path)
    del saved["model"]["0.experts.local_experts.1.linear_fc2.weight"]
    torch.save(saved, path)
    with pytest.raises(ValueError, match=r"layer 0.moe has 4 experts but no w2_eFD for expert\(s\) \[3\]"):
        convert(str(tmp_path / "mcore"), str(tmp_path / "back"), "fmoe")
    state = model_tensors(src)
    del state["model/1.moe.experts.b1_eF@expert0"]
    with single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "partial")), no_dist=True)
    with pytest.raises(ValueError, match=r"layer 1.moe has 4 experts but no b1_eF for expert\(s\) \[0\]"):
        read(str(tmp_path / "partial")).check_whole("partial")


def test_bad_arguments_fail_at_once(source, tmp_path):
    src, _ = source
    with pytest.raises(ValueError, match="--ep-size 3 must divide the 4 experts"):
        convert(src, str(tmp_path / "x"), "megatron", 3)
    with pytest.raises(ValueError, match="--to must be one of"):
        convert(src, str(tmp_path / "x"), "deepspeed")
    with pytest.raises(ValueError, match="neither an fmoe checkpoint"):
        convert(str(tmp_path), str(tmp_path / "x"), "fmoe")


class GPTLike(nn.Module):
    """Megatron-Core GPT names: embedding, decoder.layers.<i> (each with an fmoe MoE), final norm, output layer."""

    def __init__(self, num_layers=4):
        super().__init__()
        self.embedding = nn.Embedding(16, D)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(Block("gelu", "naive") for _ in range(num_layers))
        self.decoder.final_layernorm = nn.LayerNorm(D)
        self.output_layer = nn.Linear(D, 16, bias=False)


@pytest.fixture(scope="module")
def gpt_source(tmp_path_factory):
    torch.manual_seed(1)
    model = GPTLike()
    path = str(tmp_path_factory.mktemp("convert_pp") / "fmoe")
    save_checkpoint(path, model, None)
    return path, model


@pytest.mark.parametrize("pp_size, ep_size", [(2, 1), (2, 2), (4, 2)])
def test_round_trip_through_pipeline_sharded_megatron_is_exact(gpt_source, tmp_path, pp_size, ep_size):
    src, model = gpt_source
    assert main(["convert", src, str(tmp_path / "mcore"), "--to", "megatron", "--pp-size", str(pp_size),
                 "--ep-size", str(ep_size)]) == 0
    folder = tmp_path / "mcore" / "iter_0000000"
    expected = [f"mp_rank_00_{p:03d}" + (f"_{e:03d}" if ep_size > 1 else "")
                for p in range(pp_size) for e in range(ep_size)]
    assert sorted(d.name for d in folder.iterdir()) == expected
    per_stage = 4 // pp_size
    last = torch.load(folder / expected[-1] / MEGATRON_FILE)["model"]
    first = torch.load(folder / expected[0] / MEGATRON_FILE)["model"]
    # Each stage numbers its layers from 0: the last stage's layer 0 is the model's layer 4 - per_stage.
    g = 4 - per_stage
    assert torch.equal(last["decoder.layers.0.norm.weight"],
                       model.decoder.layers[g].norm.weight.detach())
    assert torch.equal(last["decoder.layers.0.router.weight"],
                       model.decoder.layers[g].moe.gate.gate.proj.weight.detach())
    assert not any(k.startswith(f"decoder.layers.{per_stage}.") for k in last)
    assert "embedding.weight" in first and "embedding.weight" not in last
    assert "output_layer.weight" in last and "decoder.final_layernorm.weight" in last
    assert pp_size == 1 or "output_layer.weight" not in first
    convert(str(tmp_path / "mcore"), str(tmp_path / "back"), "fmoe")
    before, after = model_tensors(src), model_tensors(str(tmp_path / "back"))
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_pipeline_sharding_that_cannot_work_fails_at_once(gpt_source, source, tmp_path):
    with pytest.raises(ValueError, match="--pp-size 3 must divide the 4 layers"):
        convert(gpt_source[0], str(tmp_path / "x"), "megatron", pp_size=3)
    with pytest.raises(ValueError, match="must be decoder.layers.0..L-1"):
        convert(source[0], str(tmp_path / "x"), "megatron", pp_size=2)
    convert(gpt_source[0], str(tmp_path / "mcore"), "megatron", ep_size=2, pp_size=2)
    shutil.rmtree(tmp_path / "mcore" / "iter_0000000" / "mp_rank_00_001_000")
    with pytest.raises(Exception, match="mp_rank_00_001_000 missing"):
        convert(str(tmp_path / "mcore"), str(tmp_path / "back"), "fmoe")
