"""fmoe inside Megatron-Core, on 2 real processes (gloo, CPU).

One 2-rank run does every stage and writes what it saw; the tests below read it:
  1. expert parallel 2: 6 training steps (gshard gate: capacity, random routing, balance loss),
     a checkpoint at step 3, then a fresh model resumed from it for steps 4-6;
  2. the MegatronMLP of a GPT layer against a standalone FMoETransformerMLP with its weights, and
     with a padding mask against the layer run on the real tokens alone;
  3. routing statistics: one step of 2 micro-batches with moe_per_layer_logging, logged through
     Megatron-Core's MoE tracker;
  4. one model trained at three layouts from the same checkpoint, the expert gradients reduced by
     Megatron's DDP each time: expert parallel 2 (data parallel 2), data parallel 2 with all experts
     on each rank (built with fmoefy, 2 microbatches a step), tensor parallel 2 + sequence parallel
     (expert parallel 2).
"""
import json
import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'fmoe[megatron]')")

from tests.dist_utils import run_ranks  # noqa: E402

VOCAB, SEQ, HIDDEN, FFN, EXPERTS = 64, 32, 32, 64, 4


def gpt(ep_size: int, tp_size: int = 1, gate="gshard", gate_kwargs=None, aux_loss_coeff=0.01, use_fmoefy=False,
        **mlp_params):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from fmoe.integrations.megatron import fmoefy, get_gpt_layer_with_fmoe_spec

    moe = {} if use_fmoefy else dict(num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN,
                                      expert_model_parallel_size=ep_size)
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN,
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               use_cpu_initialization=True, tensor_model_parallel_size=tp_size,
                               sequence_parallel=tp_size > 1, **moe)
    if use_fmoefy:
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                         max_sequence_length=SEQ)
        return fmoefy(model, num_experts=EXPERTS, top_k=2, gate=gate, gate_kwargs=gate_kwargs,
                      aux_loss_coeff=aux_loss_coeff, **mlp_params)
    spec = get_gpt_layer_with_fmoe_spec(gate=gate, gate_kwargs=gate_kwargs, aux_loss_coeff=aux_loss_coeff,
                                        **mlp_params)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def batch(step: int, part: int, rows: int = 4):
    """A learnable byte stream: every other token is a function of the one before."""
    g = torch.Generator().manual_seed(1000 * step + part)
    t = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    t[:, 1::2] = (t[:, 0:-1:2] * 3 + 1) % VOCAB
    return t[:, :-1], t[:, 1:]


def train(model, optimizer, steps, dp_rank, dp_size, num_microbatches=1):
    """Steps on the global batch of rows 4 * 2: this data-parallel rank's share of it, in microbatches."""
    from fmoe.integrations.megatron import training

    losses = []
    for step in steps:
        parts = [batch(step, p) for p in range(2)]
        mine = [parts[p] for p in range(2) if p % dp_size == dp_rank]
        tokens, labels = torch.cat([m[0] for m in mine]), torch.cat([m[1] for m in mine])
        micro = list(zip(tokens.chunk(num_microbatches), labels.chunk(num_microbatches)))
        losses.append(training.train_step(model, optimizer, micro)[0])
    return losses


def set_layout(tp_size, ep_size, seed=7):
    from megatron.core import parallel_state

    from fmoe.integrations.megatron import training

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    training.initialize(tp_size, ep_size, seed=seed)
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def same_on_both_ranks(tensor) -> bool:
    import torch.distributed as dist

    both = [torch.empty_like(tensor) for _ in range(2)]
    dist.all_gather(both, tensor.detach().contiguous())
    return torch.equal(both[0], both[1])


def stage_train_and_resume(ckpt):
    from fmoe.integrations.megatron import training

    dp_rank, dp_size = set_layout(1, 2)
    model, optimizer = training.wrap(gpt(2), lr=3e-3)
    experts = {n: (tuple(p.shape), getattr(p, "allreduce", True))
               for n, p in model.named_parameters() if ".experts." in n}
    first_layer = model.module.decoder.layers[0].mlp.moe
    init = {"gate": same_on_both_ranks(first_layer.gate.gate.proj.weight),
            "experts": same_on_both_ranks(first_layer.experts.w1_eDF)}
    losses = train(model, optimizer, range(3), dp_rank, dp_size)
    training.save_checkpoint(ckpt, model, optimizer, 3)
    losses += train(model, optimizer, range(3, 6), dp_rank, dp_size)
    model, optimizer = training.wrap(gpt(2), lr=3e-3)
    start = training.load_checkpoint(ckpt, model, optimizer)
    resumed = train(model, optimizer, range(start, 6), dp_rank, dp_size)
    return {"losses": losses, "resumed": resumed, "experts": experts, "same_init": init}


def stage_mlp_matches_fmoe():
    from megatron.core import parallel_state

    from fmoe import FMoETransformerMLP

    set_layout(1, 2)
    gate_kwargs = {"random_routing": False, "capacity": None}
    model = gpt(2, gate_kwargs=gate_kwargs, aux_loss_coeff=0.1)
    mlp = model.decoder.layers[0].mlp
    seen = {}

    def keep_input(module, args, output):
        seen.setdefault("x", args[0].detach())

    mlp.register_forward_hook(keep_input)
    tokens, labels = batch(0, parallel_state.get_expert_model_parallel_rank())
    model(tokens, torch.arange(SEQ).expand_as(tokens), None, labels=labels)

    standalone = FMoETransformerMLP(num_expert=EXPERTS // 2, d_model=HIDDEN, d_hidden=FFN, world_size=2,
                                    moe_group=parallel_state.get_expert_model_parallel_group(), top_k=2,
                                    gate="gshard", gate_kwargs=gate_kwargs, gate_bias=False, expert_bias=False)
    standalone.load_state_dict(mlp.moe.state_dict())
    w = torch.randn(seen["x"].shape, generator=torch.Generator().manual_seed(3))
    x_m, x_s = seen["x"].clone().requires_grad_(), seen["x"].clone().requires_grad_()
    out_m, bias = mlp(x_m)
    (out_m * w).sum().backward()
    out_s = standalone(x_s)
    ((out_s * w).sum() + 0.1 * standalone.aux_loss).backward()
    grads_s = dict(standalone.named_parameters())
    diffs = {"output": (out_m - out_s).abs().max().item(), "input grad": (x_m.grad - x_s.grad).abs().max().item()}
    for name, p in mlp.moe.named_parameters():
        diffs[name] = (p.grad - grads_s[name].grad).abs().max().item()
    try:
        from fmoe.integrations.megatron import MegatronMLP

        MegatronMLP(model.config, num_experts=3)
        bad_count = "no error"
    except ValueError as err:
        bad_count = str(err)
    return {"diffs": diffs, "bias": bias is None, "aux_loss": standalone.aux_loss.item(), "bad_count": bad_count}


def stage_padding_mask():
    """Padded tokens (different ones on each rank) go to no expert and get zeros; the real tokens' outputs
    and gradients equal the layer run on the real tokens alone."""
    from megatron.core import parallel_state

    set_layout(1, 2)
    mlp = gpt(2, gate_kwargs={"random_routing": False, "capacity": None}).decoder.layers[0].mlp.eval()
    g = torch.Generator().manual_seed(11 + parallel_state.get_expert_model_parallel_rank())
    x_SBH = torch.randn(SEQ, 2, HIDDEN, generator=g)
    padding_BS = torch.rand(2, SEQ, generator=g) < 0.3
    w = torch.randn(x_SBH.shape, generator=g)
    x_m, x_s = x_SBH.clone().requires_grad_(), x_SBH.clone().requires_grad_()
    out, _ = mlp(x_m, padding_mask=padding_BS)
    (out * w).sum().backward()
    routed = mlp.moe.last_counts_E.sum().item()
    keep_SB = ~padding_BS.t()
    mlp.zero_grad()
    alone = mlp.moe(x_s[keep_SB])
    (alone * w[keep_SB]).sum().backward()
    try:
        mlp(x_SBH, padding_mask=padding_BS.t())
        bad_shape = "no error"
    except ValueError as err:
        bad_shape = str(err)
    return {"padded_out": out[~keep_SB].abs().max().item(), "padded_grad": x_m.grad[~keep_SB].abs().max().item(),
            "out": (out[keep_SB] - alone).abs().max().item(),
            "grad": (x_m.grad[keep_SB] - x_s.grad[keep_SB]).abs().max().item(),
            "routed": routed, "expected_routed": 2 * int(keep_SB.sum()), "bad_shape": bad_shape}


class RecordingWriter:
    """A TensorBoard writer that keeps what it is given."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = (step, float(value))


def stage_routing_stats():
    """Each layer's routing statistics of every micro-batch (this rank's tokens), from the slots and
    logits its gate saw, and what log_moe_metrics wrote of them."""
    from fmoe.integrations.megatron import training

    dp_rank, dp_size = set_layout(1, 2)
    model, optimizer = training.wrap(gpt(2, gate="naive", gate_kwargs={"capacity": 0.5}), lr=3e-3)
    model.config.moe_per_layer_logging = True
    routed = []
    for layer in model.module.decoder.layers:
        moe = layer.mlp.moe
        routed.append([])
        moe.gate_hook = lambda idx, w, _, seen=routed[-1], moe=moe: seen.append(
            (idx.tolist(), moe.gate.last_logits_TE.tolist()))
    train(model, optimizer, [0], dp_rank, dp_size, num_microbatches=2)
    writer = RecordingWriter()
    training.log_moe_metrics(model, 1, 2, writer=writer)
    return {"routed": routed, "scalars": writer.scalars}


def stage_layouts(ckpt):
    """Save after one step at expert parallel 2, then train 3 more steps at each layout from there."""
    from fmoe.integrations.megatron import training

    runs = {}
    for name, tp_size, ep_size in (("ep2_dp2", 1, 2), ("ep1_dp2_fmoefy", 1, 1), ("tp2_sp_ep2", 2, 2)):
        dp_rank, dp_size = set_layout(tp_size, ep_size)
        model, optimizer = training.wrap(gpt(ep_size, tp_size, gate="naive", use_fmoefy=ep_size == 1), lr=3e-3)
        if name == "ep2_dp2":
            train(model, optimizer, range(1), dp_rank, dp_size)
            training.save_checkpoint(ckpt, model, optimizer, 1)
        else:
            training.load_checkpoint(ckpt, model, optimizer, rng=False)
        runs[name] = train(model, optimizer, range(1, 4), dp_rank, dp_size, num_microbatches=2 if ep_size == 1 else 1)
    return runs


def stage_fp8():
    """The MegatronMLP with fp8="blockwise" (a spec's mlp_params): its experts run the recipe, and the model's
    logits stay within FP8's error of the same model without it."""
    set_layout(1, 2)
    logits, state = {}, None
    for recipe in (None, "blockwise"):
        model = gpt(2, gate="naive", fp8=recipe)
        if state is None:
            state = model.state_dict()
        else:       # the same weights: no FP8 state, so the state dict loads either way
            model.load_state_dict(state)
        tokens, _ = batch(0, 0)
        with torch.no_grad():
            logits[recipe] = model(tokens, torch.arange(SEQ).expand_as(tokens), None)
        recipes = [layer.mlp.moe.experts.fp8 for layer in model.decoder.layers]
    error = float((logits["blockwise"] - logits[None]).norm() / logits[None].norm())
    return {"recipes": recipes, "error": error}


def worker(rank, world_size, out_dir):
    from megatron.core import parallel_state

    result = {"train_and_resume": stage_train_and_resume(os.path.join(out_dir, "ckpt_resume")),
              "mlp": stage_mlp_matches_fmoe(),
              "padding": stage_padding_mask(),
              "routing_stats": stage_routing_stats(),
              "fp8": stage_fp8(),
              "layouts": stage_layouts(os.path.join(out_dir, "ckpt_layouts"))}
    parallel_state.destroy_model_parallel()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("megatron"))
    run_ranks(worker, 2, out_dir)
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(2)]


def test_expert_parallel_training_loss_falls(runs):
    losses = runs[0]["train_and_resume"]["losses"]
    assert losses[-1] < losses[0] - 0.05, losses


def test_experts_are_split_and_marked_for_megatron(runs):
    stage = runs[0]["train_and_resume"]
    assert stage["same_init"] == {"gate": True, "experts": False}, "gate replicated, experts from per-rank RNG"
    experts = stage["experts"]
    assert experts, "no expert parameters found"
    for name, (shape, allreduce) in experts.items():
        assert shape[0] == EXPERTS // 2, (name, shape)
        assert allreduce is False, name


def test_resume_continues_like_an_uninterrupted_run(runs):
    for rank_runs in runs:
        stage = rank_runs["train_and_resume"]
        assert stage["resumed"] == pytest.approx(stage["losses"][3:], abs=1e-6)


def test_megatron_mlp_equals_standalone_fmoe_layer(runs):
    for rank_runs in runs:
        mlp = rank_runs["mlp"]
        assert mlp["bias"] and mlp["aux_loss"] > 0
        assert max(mlp["diffs"].values()) < 1e-5, mlp["diffs"]
        assert "num_experts must be a positive multiple of the expert parallel size 2" in mlp["bad_count"]


def test_padding_mask_routes_padded_tokens_nowhere(runs):
    for rank_runs in runs:
        pad = rank_runs["padding"]
        assert pad["padded_out"] == 0 and pad["padded_grad"] == 0, pad
        assert pad["out"] < 1e-6 and pad["grad"] < 1e-6, pad
        assert pad["routed"] == pad["expected_routed"], pad
        assert "padding_mask must be [batch, seq]" in pad["bad_shape"], pad


def test_megatron_mlp_runs_fmoes_fp8_recipe(runs):
    for rank_runs in runs:
        assert rank_runs["fp8"]["recipes"] == ["blockwise", "blockwise"]
        assert 0 < rank_runs["fp8"]["error"] < 0.08, rank_runs["fp8"]


def test_layouts_train_alike_from_one_checkpoint(runs):
    layouts = runs[0]["layouts"]
    for name in ("ep1_dp2_fmoefy", "tp2_sp_ep2"):
        assert layouts[name] == pytest.approx(layouts["ep2_dp2"], abs=1e-4), (name, layouts)


def test_megatron_logs_each_layers_routing_statistics_averaged_over_micro_batches_and_ranks(runs):
    from tests.test_stats import reference

    stats_names = ("max_load", "mean_load", "load_cv", "empty_experts", "dropped_slots", "unrouted_slots",
                   "router_entropy")
    stages = [rank_runs["routing_stats"] for rank_runs in runs]
    routing = [{tag: v for tag, v in stage["scalars"].items() if "routing_" in tag} for stage in stages]
    assert len(routing[0]) == 7 * 3 and routing[0] == routing[1], "each statistic per layer and their average"
    for layer in range(2):
        micro = [m for stage in stages for m in stage["routed"][layer]]
        assert len(micro) == 4, "2 ranks x 2 micro-batches"
        expected = [reference(torch.tensor(idx), torch.tensor(logits), unrouted_by_gate=False) for idx, logits in micro]
        assert all(e["dropped_slots"] > 0 for e in expected)
        for name in stats_names:
            step, value = stages[0]["scalars"][f"moe/routing_{name}_layer_{layer}"]
            assert step == 1 and value == pytest.approx(sum(e[name] for e in expected) / 4, rel=1e-5), name
    for name in stats_names:
        assert stages[0]["scalars"][f"routing_{name}"][1] == pytest.approx(
            sum(stages[0]["scalars"][f"moe/routing_{name}_layer_{i}"][1] for i in range(2)) / 2, rel=1e-5)
