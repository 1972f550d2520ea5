"""Save, load and resume a model converted at the experts seam (#53, item 3), on 2 gloo ranks: its
`save_pretrained` at ep_size=2 writes the family's own layout with every expert gathered, which plain
transformers loads equal to the unconverted model; its sharded checkpoint (fmoe.distributed.checkpoint,
experts by global id) resumes at ep_size=1 from 2 and at 2 from 1, model and optimizer alike."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import fmoe.integrations.hf  # noqa: E402
from fmoe.distributed.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from fmoe.integrations.hf.seam import seam_layers  # noqa: E402
from tests import seam_workers  # noqa: E402
from tests.dist_utils import run_ranks  # noqa: E402
from tests.hf_families import assert_close_fp32, build_error, output, tiny, tokens  # noqa: E402

# Transposed experts with biases (gpt_oss), a selection-bias buffer and shared experts (deepseek_v3), a
# hybrid with linear attention and a gated shared expert (qwen3_5_moe).
NAMES = ["deepseek_v3", "gpt_oss", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family's one-process checkpoint after one Adam step (and its entries); then the 2-rank run."""
    folder = tmp_path_factory.mktemp("seam-checkpoints")
    for name in NAMES:
        if build_error(name):
            pytest.fail(build_error(name))
        model = fmoe.integrations.hf.convert(tiny(name), seam=True)
        optimizer = seam_workers.step(model, tokens())
        save_checkpoint(str(folder / name / "ep1"), model, optimizer)
        torch.save(seam_workers.tensors_of(model, optimizer), folder / name / "ep1.pt")
    run_ranks(seam_workers.save_and_resume, 2, NAMES, str(folder))
    return folder


@pytest.mark.parametrize("writer", ["hf", "export"])
@pytest.mark.parametrize("name", NAMES)
def test_seam_save_pretrained_at_ep2_loads_in_plain_transformers_equal_to_the_unconverted(name, writer, saved):
    """What `save_pretrained` and `fmoe.integrations.hf.export` wrote at ep_size=2."""
    model = tiny(name)
    plain = type(model).from_pretrained(saved / name / writer).eval()
    assert not seam_layers(plain)
    want, got = model.state_dict(), plain.state_dict()
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    ids = tokens()
    with torch.no_grad():           # from_pretrained may choose another attention kernel than the tiny model's eager
        assert_close_fp32(output(plain, ids), output(model, ids), f"{name} reloaded")


@pytest.mark.parametrize("name", NAMES)
def test_seam_checkpoint_saved_at_ep2_resumes_at_ep1(name, saved):
    """The ranks' entries together are the checkpoint; a one-process seam model of another seed loads it."""
    want = {}
    for rank in range(2):
        for key, value in torch.load(saved / name / f"ep2-{rank}.pt").items():
            assert key not in want or torch.equal(want[key], value), f"ranks disagree on {key}"
            want[key] = value
    model = fmoe.integrations.hf.convert(seam_workers.tiny_from_seed(name, 7), seam=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    load_checkpoint(str(saved / name / "ep2"), model, optimizer)
    got = seam_workers.tensors_of(model, optimizer)
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_seam_checkpoint_saved_at_ep1_resumes_at_ep2(saved):
    """Checked on the ranks (seam_workers.save_and_resume); here only that they ran for every family."""
    for name in NAMES:
        assert (saved / name / "ep2-1.pt").is_file()


def test_seam_save_pretrained_refuses_a_state_dict_of_one_rank_s_experts(monkeypatch):
    model = fmoe.integrations.hf.convert(tiny("qwen3_moe"), seam=True)
    name, layer = seam_layers(model)[0]
    monkeypatch.setattr(layer, "world_size", 2)
    state = model.state_dict()
    state[f"{name}.gate_up_proj"] = state[f"{name}.gate_up_proj"][:2]
    with pytest.raises(ValueError, match=r"gate_up_proj holds 2 of its 4 experts .* without state_dict"):
        model.save_pretrained("unused", state_dict=state)
