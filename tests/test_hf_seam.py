"""The family sweep: every MoE family of the installed transformers whose experts dispatch through its experts
interface (found by fmoe.integrations.hf.discovery, not listed), built tiny from its own config class, runs
equal to itself with experts_implementation="fmoe" (experts only), converted at the experts seam, and
converted at the seam with ep_size=2 on 2 gloo ranks: outputs and the gradient of every parameter.

A family whose tiny model cannot be built is an xfail carrying its reason, never a silent skip.
"""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fmoe.integrations.hf  # noqa: E402
from fmoe.integrations.hf.discovery import FamilyUnavailable, discover, experts_modules  # noqa: E402
from fmoe.integrations.hf.seam import SeamGate, SeamMoE, seam_layers  # noqa: E402
from tests import seam_workers  # noqa: E402
from tests.dist_utils import run_ranks  # noqa: E402
from tests.hf_families import (assert_same_run, build_error, copied, families, forward_backward, tiny,  # noqa: E402
                               tokens)
from tests.hf_models import FAMILIES as TABLE_FAMILIES  # noqa: E402
from tests.hf_models import tiny as table_tiny  # noqa: E402

NAMES = sorted(families())
# The share of discovered families whose tiny model must build (the rest are named with their reason).
MIN_BUILT = 0.9


def needs_model(name):
    reason = build_error(name)
    if reason is not None:
        pytest.xfail(f"cannot build a tiny model: {reason}")


def test_family_discovery_finds_the_known_families_and_most_build():
    """The table families and those the issue names are found; at least MIN_BUILT of all build,
    and each that does not says why."""
    for name in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_5_moe", "qwen3_next", "glm4_moe",
                 "deepseek_v32", "deepseek_v4", "minimax_m2", "ernie4_5_moe", "hunyuan_v1_moe", "nemotron_h"):
        assert name in NAMES, f"{name} not discovered; found {NAMES}"
    failed = {name: build_error(name) for name in NAMES if build_error(name)}
    assert all(reason.startswith(name + ":") for name, reason in failed.items())
    assert len(failed) <= (1 - MIN_BUILT) * len(NAMES), f"{len(failed)} of {len(NAMES)} families do not build: {failed}"


def test_family_discovery_takes_only_the_named_folders_and_reports_what_fails():
    found = discover(["qwen3_moe", "no_such_family"])
    assert [f.name for f in found] == ["qwen3_moe"]
    family = found[0]
    family.candidates = ()
    with pytest.raises(FamilyUnavailable, match="qwen3_moe: no model class"):
        family.build()


@pytest.mark.parametrize("name", NAMES)
def test_family_experts_only_and_seam_equal_transformers(name):
    """experts_implementation="fmoe" and convert(seam=True) each equal the unconverted model."""
    needs_model(name)
    model, ids = tiny(name), tokens()
    want = forward_backward(model, ids)
    fast = copied(model)
    fast.set_experts_implementation("fmoe")
    assert_same_run(forward_backward(fast, ids), want, f"{name} experts_implementation='fmoe'")
    converted = fmoe.integrations.hf.convert(copied(model), seam=True)
    layers = seam_layers(converted)
    assert layers and not experts_modules(converted) or all(isinstance(m, SeamMoE) for _, m in layers)
    assert len(layers) == len(experts_modules(model))
    assert_same_run(forward_backward(converted, ids), want, f"{name} convert(seam=True)")
    for _, layer in layers:
        stats = layer.routing_stats
        assert stats and layer.num_dropped == 0
        assert int(layer.last_counts_E.sum()) == ids.numel() * layer.gate.top_k


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory):
    """Every buildable family at ep_size=2, in one pair of processes."""
    names = [name for name in NAMES if build_error(name) is None]
    path = tmp_path_factory.mktemp("seam-ep") / "results.json"
    run_ranks(seam_workers.sweep_ep, 2, names, str(path))
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", NAMES)
def test_family_seam_ep2_equals_one_process(name, ep_results):
    needs_model(name)
    assert ep_results[name] == "ok", ep_results[name]


def test_seam_is_the_default_for_families_outside_the_table_and_an_option_for_the_table():
    qwen35 = tiny("qwen3_5_moe")
    fmoe.integrations.hf.convert(qwen35)
    assert seam_layers(qwen35)
    mixtral = tiny("mixtral")
    fmoe.integrations.hf.convert(copied(mixtral))           # the table's full conversion
    assert not seam_layers(fmoe.integrations.hf.convert(copied(mixtral), seam=False))
    assert seam_layers(fmoe.integrations.hf.convert(mixtral, seam=True))
    with pytest.raises(ValueError, match="unknown MoE family.*seam=True"):
        fmoe.integrations.hf.convert(tiny("qwen3_5_moe"), seam=False)


def test_seam_convert_refuses_bad_input_naming_it():
    model = tiny("qwen3_moe")
    with pytest.raises(ValueError, match="seam must be True, False or None"):
        fmoe.integrations.hf.convert(model, seam="yes")
    with pytest.raises(ValueError, match="ep_size=3 must be a positive divisor of its 4 experts"):
        fmoe.integrations.hf.convert(model, ep_size=3, seam=True)
    with pytest.raises(ValueError, match=r"options \['top_k'\] are not taken at the seam"):
        fmoe.integrations.hf.convert(model, seam=True, top_k=1)
    with pytest.raises(ValueError, match="needs torch.distributed"):
        fmoe.integrations.hf.convert(model, ep_size=2, seam=True)
    assert not seam_layers(model)                            # every refusal left the model unchanged
    fmoe.integrations.hf.convert(model, seam=True)
    with pytest.raises(ValueError, match="already converted"):
        fmoe.integrations.hf.convert(model, seam=True)
    layer = seam_layers(model)[0][1]
    with pytest.raises(ValueError, match="pass hidden_states, top_k_index and top_k_weights"):
        layer(torch.randn(3, layer.d_model))
    with pytest.raises(ValueError, match=r"both be \[tokens, top_k\]"):
        layer.gate.hand(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 1))


def test_seam_gate_counts_slots_outside_the_experts_and_drops_over_capacity():
    """transformers' expert-parallel sentinels (ids >= E) reach no expert and count as unrouted;
    a capacity drops each expert's lowest-weight slots and counts them."""
    gate = SeamGate(8, 4, top_k=2)
    idx = torch.tensor([[0, 4], [1, 2]])
    gate.hand(idx, torch.tensor([[0.7, 0.3], [0.6, 0.4]]))
    routing = gate.routing(torch.randn(2, 8))
    assert routing.expert_idx_TK.tolist() == [[0, -1], [1, 2]] and routing.weight_TK[0, 1] == 0
    assert int(routing.num_dropped) == 1 and int(routing.num_unrouted) == 1
    capped = SeamGate(8, 4, top_k=2, capacity=0.5)     # 1 slot per expert for 4 tokens x 2 / 4 experts x 0.5
    weights = torch.arange(8.).view(4, 2) + 0.5
    capped.hand(torch.tensor([[0, 1], [0, 2], [3, 1], [2, 3]]), weights)
    routing = capped.routing(torch.randn(4, 8))
    assert int(routing.num_dropped) == 4
    assert routing.expert_idx_TK.tolist() == [[-1, -1], [0, -1], [-1, 1], [2, 3]]


def test_seam_state_dict_keeps_the_family_keys_and_reloads_in_plain_transformers(tmp_path):
    model = tiny("qwen3_5_moe")
    ids = tokens()
    with torch.no_grad():
        want = model(ids).logits
    converted = fmoe.integrations.hf.convert(copied(model), seam=True)
    assert set(converted.state_dict()) == set(model.state_dict())
    converted.save_pretrained(tmp_path)
    plain = type(model).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, want)
    again = fmoe.integrations.hf.convert(copied(model), seam=True)
    for _, layer in seam_layers(again):
        torch.nn.init.zeros_(layer.experts.gate_up_proj)
    again.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want)


@pytest.mark.parametrize("family", TABLE_FAMILIES)
def test_family_init_weights_after_full_convert(family):
    """transformers' initialisation pass runs on a converted model (#53, item 7): the router stand-in
    shows the family's router tensors as views of fmoe's gate, which the family's init then draws anew;
    the views add nothing to the state dict and follow a deep copy."""
    model = table_tiny(family)
    converted = fmoe.integrations.hf.convert(copied(model))
    keys = set(converted.state_dict())
    (_, block), *_ = fmoe.integrations.hf.converted_blocks(converted)
    router_weight = block.moe.gate.gate.proj.weight
    if hasattr(block.router, "weight"):
        assert block.router.weight is router_weight
    converted.post_init()
    converted.init_weights()
    assert set(converted.state_dict()) == keys
    std = converted.config.get_text_config().initializer_range
    assert float(router_weight.detach().std()) < 3 * std < 0.3        # drawn anew (tiny() drew it at 0.3)
    again = copied(converted)
    (_, block_copy), *_ = fmoe.integrations.hf.converted_blocks(again)
    if hasattr(block_copy.router, "weight"):
        assert block_copy.router.weight is block_copy.moe.gate.gate.proj.weight
    with torch.no_grad():
        assert torch.isfinite(converted(tokens()).logits).all()


def test_seam_init_weights_draws_the_family_experts_anew():
    model = fmoe.integrations.hf.convert(tiny("qwen3_5_moe"), seam=True)
    model.init_weights()
    std = model.config.initializer_range
    for _, layer in seam_layers(model):
        assert abs(float(layer.experts.gate_up_proj.detach().std()) - std) < 0.5 * std


def test_family_table_names_each_family_that_does_not_build_with_its_reason():
    """docs/hf-families.md (tests/hf_family_table.py) says which tiny models build, as this run finds."""
    from tests.hf_family_table import parse
    from tests.test_hf_family_table import TABLE
    rows = parse(TABLE.read_text())
    for name in NAMES:
        assert rows[name]["model built"].startswith("no:") == (build_error(name) is not None), name


def test_family_seam_example_trains_qwen3_5_moe_at_ep2_and_plain_transformers_reloads_it(tmp_path):
    """#53's done-when: the example trains a tiny Qwen3.5-MoE converted at the seam on 2 processes,
    prints fmoe's routing statistics, and saves what plain transformers loads."""
    import subprocess
    import sys
    from pathlib import Path
    example = Path(__file__).resolve().parents[1] / "examples/hf/seam_ep.py"
    result = subprocess.run([sys.executable, str(example), "--steps", "2", "--out", str(tmp_path / "saved")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 1: loss" in result.stdout and "tokens per expert" in result.stdout, result.stdout
    assert "reloaded by plain transformers: Qwen3_5MoeForCausalLM" in result.stdout, result.stdout
