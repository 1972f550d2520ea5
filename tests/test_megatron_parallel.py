"""fmoe's MoE layers in Megatron-Core's pipeline schedules, at layouts of 2, 4 and 8 real processes
(gloo, CPU), each held equal to one process training the same 4-layer GPT on the same global batch.

The single process saves the initial weights; every layout loads them (resharded to its pipeline
x tensor x expert layout), trains 3 steps of 4 micro-batches and saves its final state. Equal
means: the loss of every step, every parameter and balancing bias after the last step, and the
load-balancing loss, z-loss and tokens per expert of every layer as Megatron's MoE tracker logs them. The router
moves a balancing bias once per global batch, whatever the micro-batches and stages in flight.
At each layout Megatron-Core's own MoELayer, built from the same weights, trains as fmoe's MLP does in
one process (both with SGD: Adam would turn rounding into lr-sized steps, workers.PEER_LR); and
checkpoints saved at one layout after a step resume at another as the one process continues.

`make test` runs the 2-rank subset (1F1B + interleaved virtual stages, 2 ranks); the 4- and
8-rank layouts run with FMOE_TEST_MEGATRON_PARALLEL=1 (`make test-megatron-parallel`).
"""
import json
import os
import re
import tempfile

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'fmoe[megatron]')")

from tests import megatron_parallel_workers as workers  # noqa: E402
from tests.dist_utils import run_ranks  # noqa: E402

SLOW = pytest.mark.skipif(os.environ.get("FMOE_TEST_MEGATRON_PARALLEL") != "1",
                          reason="4- and 8-rank Megatron layouts: make test-megatron-parallel")
SPEED = workers.BIAS_SPEED


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("megatron_parallel"))


_runs = {}


def run(out_dir: str, *names: str):
    """Train the layouts `names` (same world size) in one launch, once per session; their results."""
    if "single" not in _runs and names != ("single",):
        run(out_dir, "single")
    todo = [n for n in names if n not in _runs]
    if todo:
        init = None if todo == ["single"] else os.path.join(out_dir, "init")
        # One process holds fmoe's and Megatron's MoE equal for every routing; the layouts, for "deepseek".
        routings = tuple(workers.ROUTINGS) if todo == ["single"] else ("deepseek",)
        run_ranks(workers.worker, workers.LAYOUTS[todo[0]][0], out_dir, todo, init, routings)
        for name in todo:
            with open(os.path.join(out_dir, name, "result.json")) as f:
                _runs[name] = json.load(f)
            _runs[name]["final"] = final_state(os.path.join(out_dir, name, "final", f"iter_{workers.STEPS:07d}"))
    return [_runs[n] for n in names]


def final_state(folder: str) -> dict:
    """The model's tensors in a Megatron distributed checkpoint, whole, by name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder, os.path.join(tmp, "state.pt"))
        state = torch.load(os.path.join(tmp, "state.pt"), weights_only=False)
    return {k: v for k, v in state.items() if torch.is_tensor(v) and k.split(".")[0] in
            ("embedding", "decoder", "output_layer")}


def assert_same_final_state(name, layout, single):
    """Every tensor equal up to fp32 rounding through Adam: Adam divides each gradient by its own
    size, so the few elements whose gradient is near 0 (here about 150 of 88k under tensor
    parallelism, whose reductions add in another order) move by up to lr on rounding alone; the
    mean difference bounds everything else (a wrong gradient moves many elements)."""
    assert set(layout["final"]) == set(single["final"])
    for key, tensor in single["final"].items():
        diff_ = (layout["final"][key] - tensor).abs()
        assert diff_.max().item() < 1e-3 and diff_.mean().item() < 5e-6, \
            (name, key, diff_.max().item(), diff_.mean().item())


def assert_equal_to_one_process(out_dir, name, *same_launch):
    single, layout = run(out_dir, "single", name, *same_launch)[:2]
    assert layout["losses"] == pytest.approx(single["losses"], abs=2e-5), (name, layout["losses"], single["losses"])
    assert single["losses"][-1] < single["losses"][0], "the model learns"
    assert_same_final_state(name, layout, single)
    megatron, fmoe_sgd = layout["megatron"]["deepseek"], single["fmoe_sgd"]["deepseek"]
    assert megatron["losses"] == pytest.approx(fmoe_sgd["losses"], abs=2e-5), \
        (name, "Megatron's MoE", megatron["losses"], fmoe_sgd["losses"])
    biases = [k for k in single["final"] if k.endswith("e_score_correction_bias")]
    assert biases and all(single["final"][k].abs().max() > 0 for k in biases), "the balancing biases moved"
    for step in range(workers.STEPS):
        # Once per global batch: every bias entry moved by the speed (or by nothing), never twice.
        for moves in layout["bias_moves"][step] + single["bias_moves"][step] + megatron["bias_moves"][step]:
            assert all(m == 0.0 or m == pytest.approx(SPEED) for m in moves), (name, step, moves)
        for layer in range(workers.LAYERS):
            # Each micro-batch of a data-parallel rank routes its 2 x 32 tokens to 2 experts each.
            assert sum(single["logged"][step][f"moe/tokens_per_expert_{e}_layer_{layer}"]
                       for e in range(workers.EXPERTS)) == workers.MICRO_ROWS * workers.SEQ * 2
            for loss in ("load_balancing_loss", "z_loss") + tuple(f"tokens_per_expert_{e}"
                                                                    for e in range(workers.EXPERTS)):
                tag = f"moe/{loss}_layer_{layer}"
                assert single["logged"][step][tag] > 0 or loss.startswith("tokens"), (step, tag)
                assert layout["logged"][step][tag] == pytest.approx(single["logged"][step][tag], rel=1e-5), \
                    (name, step, tag)


def assert_resumed_like_one_process(out_dir, name, *same_launch):
    """`name` = "<layout>_from_<layout>": resumed from the other layout's checkpoint after RESUME_AT
    steps (model, Adam's moments, balancing biases resharded), it continues as one process."""
    single, resumed = run(out_dir, "single", *same_launch, name)[::len(same_launch) + 1]
    assert resumed["losses"] == pytest.approx(single["losses"][workers.RESUME_AT:], abs=2e-5), (name, resumed)
    assert_same_final_state(name, resumed, single)


FAST = ("pp2_vpp2", "pp2_from_pp2_vpp2")
FOUR_RANKS = ("pp2_ep2", "pp2_tp2_sp", "pp2_vpp2_ep2", "pp2_vpp2_ep2_from_pp2_tp2_sp", "pp2_ep2_shadow")
EIGHT_RANKS = ("pp2_tp2_ep2", "pp2_tp2_ep2_from_pp2_vpp2_ep2")


@pytest.mark.parametrize("routing", sorted(workers.ROUTINGS))
def test_megatron_moe_layer_trains_like_fmoe_from_the_same_weights(out_dir, routing):
    """Megatron-Core's MoELayer (TopKRouter, alltoall dispatcher, SequentialMLP) and fmoe's MLP with
    gate="megatron", one process, SGD (workers.PEER_LR): the same loss at every step, the expert bias
    moved alike."""
    single, = run(out_dir, "single")
    fmoe, megatron = single["fmoe_sgd"][routing], single["megatron"][routing]
    assert megatron["losses"] == pytest.approx(fmoe["losses"], abs=2e-5), (routing, megatron, fmoe)
    assert fmoe["losses"][-1] < fmoe["losses"][0]
    assert megatron["bias_moves"] == fmoe["bias_moves"]


def test_pipeline_with_virtual_stages_on_2_ranks_equals_one_process(out_dir):
    assert_equal_to_one_process(out_dir, *FAST)


def test_checkpoint_of_virtual_stages_resumes_at_plain_pipeline_stages(out_dir):
    assert_resumed_like_one_process(out_dir, FAST[1], FAST[0])


@SLOW
@pytest.mark.parametrize("name", FOUR_RANKS[:3])
def test_4_rank_layout_equals_one_process(out_dir, name):
    run(out_dir, *FOUR_RANKS)
    assert_equal_to_one_process(out_dir, name)


@SLOW
def test_shadowing_under_1f1b_equals_one_process(out_dir):
    """FasterMoE's shadowing (first and last expert pulled by every rank, their gradients pushed back)
    while 1F1B has two micro-batches of a layer in flight: as one process without shadowing."""
    run(out_dir, *FOUR_RANKS)
    assert_equal_to_one_process(out_dir, "pp2_ep2_shadow")
    assert _runs["pp2_ep2_shadow"]["shadow_rows"] > 0 and _runs["pp2_ep2"]["shadow_rows"] == 0


@SLOW
def test_checkpoint_at_tp2_resumes_at_ep2_with_virtual_stages(out_dir):
    run(out_dir, *FOUR_RANKS)
    assert_resumed_like_one_process(out_dir, FOUR_RANKS[3])


@SLOW
def test_8_rank_layout_equals_one_process(out_dir):
    run(out_dir, *FOUR_RANKS)       # the 8-rank launch resumes from a 4-rank checkpoint
    assert_equal_to_one_process(out_dir, *EIGHT_RANKS)


@SLOW
def test_checkpoint_of_4_ranks_resumes_at_8_ranks(out_dir):
    run(out_dir, *FOUR_RANKS)
    assert_resumed_like_one_process(out_dir, EIGHT_RANKS[1], EIGHT_RANKS[0])


@pytest.mark.parametrize("kwargs, message", [
    (dict(expert_parallel_size=2, num_experts=3), "num_experts=3 is not divisible by expert_parallel_size=2"),
    (dict(pipeline_parallel_size=2, num_layers=3), "num_layers=3 is not divisible by pipeline_parallel_size=2 x "
                                                   "virtual_pipeline_parallel_size=1 = 2 model chunks"),
    (dict(pipeline_parallel_size=2, virtual_pipeline_parallel_size=2, num_layers=6),
     "num_layers=6 is not divisible by pipeline_parallel_size=2 x virtual_pipeline_parallel_size=2 = 4"),
    (dict(tensor_parallel_size=2, pipeline_parallel_size=3), "the world size 8 is not a multiple of "
                                                             "tensor_parallel_size=2 x pipeline_parallel_size=3"),
    (dict(pipeline_parallel_size=2, expert_parallel_size=8), "expert_parallel_size=8 must divide the 4 ranks of a "
                                                             "pipeline stage"),
    (dict(virtual_pipeline_parallel_size=2), "virtual_pipeline_parallel_size=2 needs pipeline_parallel_size >= 2"),
    (dict(context_parallel_size=0), "context_parallel_size must be a positive integer, got 0"),
])
def test_a_layout_that_cannot_work_is_refused_naming_the_sizes(kwargs, message):
    from fmoe.integrations.megatron.training import check_layout

    with pytest.raises(ValueError, match=re.escape(message)):
        check_layout(8, **kwargs)


@pytest.mark.parametrize("options, message", [
    (dict(moe_router_score_function="sigmoid", moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1),
     "moe_router_load_balancing_type='aux_loss' with sigmoid scores"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk=4, moe_router_pre_softmax=True),
     "moe_router_topk=4 // moe_router_group_topk=1 = 4"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=1), "moe_router_num_groups with moe_router_pre_softmax=False"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type='sinkhorn'"),
    (dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs"), "moe_expert_capacity_factor"),
])
def test_megatron_router_options_without_an_equal_fmoe_gate_are_refused(options, message):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from fmoe.integrations.megatron.router import megatron_router_options

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=8, add_bias_linear=False,
                moe_router_topk=2)
    config = TransformerConfig(**{**base, **options})
    with pytest.raises(ValueError, match=re.escape(message)):
        megatron_router_options(config)


def test_megatron_router_options_map_one_to_one():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from fmoe.integrations.megatron.router import megatron_router_options

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=8,
                               add_bias_linear=False, moe_router_topk=2, **workers.ROUTINGS["deepseek"])
    assert megatron_router_options(config) == dict(gate="router", aux_loss_coeff=1.0, gate_kwargs=dict(
        score="sigmoid", norm_topk_prob=True, selection_bias="updated", bias_update_speed=0.05, n_group=2,
        topk_group=1, group_score="top2_sum", routed_scaling_factor=2.0, aux_loss=("sequence",),
        aux_loss_coef={"sequence": 0.1}, z_loss_coef=1e-3))
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=8,
                               add_bias_linear=False, moe_router_topk=2, moe_router_load_balancing_type="aux_loss",
                               moe_aux_loss_coeff=0.1)
    assert megatron_router_options(config)["gate_kwargs"] == dict(softmax_after_topk=True, aux_loss=("switch",),
                                                                  aux_loss_coef={"switch": 0.05})


def test_initialize_refuses_a_bad_layout_on_every_rank(out_dir):
    run_ranks(workers.bad_layout_worker, 2, out_dir)
    for rank in range(2):
        with open(os.path.join(out_dir, f"bad{rank}.json")) as f:
            errors = json.load(f)
        assert "num_experts=3 is not divisible by expert_parallel_size=2" in errors["experts"], errors
        assert "num_layers=3 is not divisible by pipeline_parallel_size=2" in errors["layers"], errors
        # What stops context parallelism on a CPU: Megatron-Core's attention without Transformer Engine.
        assert errors["context_parallel"].startswith("AssertionError: Context parallelism is only supported by "
                                                     "TEDotProductAttention!"), errors
