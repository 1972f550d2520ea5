"""Router replay (R3): a replayed forward chooses exactly the recorded experts, in every mode, and its
gradients are those of a per-token loop over the recorded experts.

The compiled cases (aot_eager, fullgraph) run a few gates; FMOE_TEST_ALL_MODES=1 compiles every gate
and preset.
"""
import copy
import importlib.util
import os
import runpy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fmoe
from fmoe.gates import PRESETS
from fmoe.gates.router import RouterGate
from tests import replay_workers
from tests.dist_utils import run_ranks

D, H, E, T = 8, 12, 8, 10
ALL_MODES = os.environ.get("FMOE_TEST_ALL_MODES") == "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The learned biases here are not stepped: their warning about it is not what these tests are about.
pytestmark = pytest.mark.filterwarnings("ignore:.*moves the bias once per optimizer step")

# (name, gate, top_k, gate_kwargs): every gate class, then all 11 presets.
GATES = [
    ("naive", "naive", 2, {}),
    ("noisy", "noisy", 2, {}),
    ("gshard", "gshard", 2, {}),                 # capacity (1.2, 2.4) and random routing: -1 slots recorded
    ("switch", "switch", 1, {}),
    ("balanced", "balanced", 2, {"capacity": 0.5}),
    ("faster", "faster", 2, {"gpus_per_node": 1}),
    ("dc", "dc", 2, {}),
    ("swipe", "swipe", 2, {}),
    ("zero", "zero", 2, {}),
    ("router_all_losses", "router", 2, {"aux_loss": ("switch", "sequence", "global"), "z_loss_coef": 0.1,
                                        "selection_bias": "updated"}),
] + [(f"preset_{name}", name, 2, {}) for name in sorted(PRESETS)]
GROUPS = {"deepseek_v3": {"n_group": 4, "topk_group": 2}}      # the preset's 8 groups need more experts
assert len(PRESETS) == 11


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: torch's thread pool only waits for the busy cores (a gelu of 10 rows took 14 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_layer(gate, top_k, kwargs, seed=0, **layer_kwargs):
    torch.manual_seed(seed)
    if gate in PRESETS:
        gate = RouterGate.from_preset(gate, D, E, top_k=top_k, **GROUPS.get(gate, {}), **kwargs)
        kwargs = {}
    return fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=H, top_k=top_k, gate=gate, gate_kwargs=kwargs,
                                   **layer_kwargs)


def perturbed(layer, seed=1):
    """A copy whose router differs enough to choose other experts."""
    other = copy.deepcopy(layer)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.gate.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype))
    return other


def inputs(n=T, seed=7, dtype=torch.float32):
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


def recorded(layer, *xs):
    with fmoe.record_routing(layer) as trace, torch.no_grad():
        for x in xs:
            layer(x)
    return trace


class Choices:
    """Every routing the layers' gates return while open (through FMoE's gate_hook)."""

    def __init__(self, *layers):
        self.layers, self.seen = layers, []

    def __enter__(self):
        for layer in self.layers:
            layer.gate_hook = lambda idx, weight, _: self.seen.append(idx.clone())
        return self.seen

    def __exit__(self, *exc):
        for layer in self.layers:
            layer.gate_hook = None


@pytest.mark.parametrize("name,gate,top_k,kwargs", GATES, ids=[g[0] for g in GATES])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_replay_chooses_the_recorded_experts_for_every_gate_and_preset(name, gate, top_k, kwargs, training):
    rollout = make_layer(gate, top_k, kwargs).eval()
    trainer = perturbed(rollout).train(training)
    xs = [inputs(seed=s) for s in (7, 8)]
    trace = recorded(rollout, *xs)
    with Choices(trainer) as free, torch.no_grad():
        for x in xs:
            trainer(x)
    if gate != "zero":
        assert any(not torch.equal(a, b) for a, b in zip(free, trace[""])), "the perturbed router chose alike"
    with fmoe.replay_routing(trainer, trace), Choices(trainer) as replayed:
        for x in xs:
            trainer(x.clone().requires_grad_(True)).sum().backward()
    assert len(replayed) == 2
    for got, want in zip(replayed, trace[""]):
        assert torch.equal(got, want)
    assert torch.equal(trainer.last_counts_E, count(trace[""][1]))
    grads = [p.grad for p in trainer.gate.parameters() if p.requires_grad]
    if gate != "zero":
        assert any(g is not None and g.abs().sum() > 0 for g in grads), "the router has its gradient under replay"


def count(idx_TK, experts=E):
    live = idx_TK[idx_TK >= 0]
    return torch.bincount(live, minlength=experts)


COMPILED = GATES if ALL_MODES else [g for g in GATES if g[0] in ("gshard", "noisy", "preset_deepseek_v3",
                                                                 "preset_phimoe")]


@pytest.mark.parametrize("name,gate,top_k,kwargs", COMPILED, ids=[g[0] for g in COMPILED])
def test_compiled_replay_equals_eager_replay(name, gate, top_k, kwargs):
    """fullgraph: the recorded experts enter the compiled layer as a tensor computed when it runs; a
    second replay (a new trace) reuses the graph."""
    torch._dynamo.reset()
    rollout = make_layer(gate, top_k, kwargs).eval()
    xs = [inputs(seed=s) for s in (7, 8)]
    trace = recorded(rollout, *xs)
    trainer = perturbed(rollout).train()
    eager = copy.deepcopy(trainer)
    compiled = torch.compile(trainer, fullgraph=True, backend="aot_eager")
    results = []
    for module, run in ((eager, eager), (trainer, compiled)):
        outs = []
        for _ in range(2):
            with fmoe.replay_routing(module, trace):
                for x in xs:
                    torch.manual_seed(3)
                    outs.append(run(x))
                    assert torch.equal(module.last_counts_E, count(trace[""][(len(outs) - 1) % 2]))
        outs[-1].sum().backward()
        results.append((outs, [p.grad for p in module.gate.parameters()]))
    (outs_e, grads_e), (outs_c, grads_c) = results
    for a, b in zip(outs_c, outs_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compiled_record_equals_eager_record():
    torch._dynamo.reset()
    layer = make_layer("gshard", 2, {}).train()
    eager = copy.deepcopy(layer)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    traces = []
    for module, run in ((eager, eager), (layer, compiled)):
        with fmoe.record_routing(module) as trace:
            torch.manual_seed(5)
            run(inputs())
        traces.append(trace)
    assert torch.equal(traces[0][""][0], traces[1][""][0])
    assert (traces[0][""][0] < 0).any()        # random routing and capacity left slots unrouted


@pytest.mark.parametrize("recompute,use_reentrant", [("activation", False), ("activation", True), ("experts", False),
                                                     ("none", True)])
def test_recompute_replays_the_same_entry_in_every_recompute_mode(recompute, use_reentrant):
    check_checkpointed_replay("qwen3_moe", 2, {}, recompute, use_reentrant)


@pytest.mark.parametrize("name,gate,top_k,kwargs", GATES, ids=[g[0] for g in GATES])
def test_recompute_replays_the_same_entry_for_every_gate_and_preset(name, gate, top_k, kwargs):
    check_checkpointed_replay(gate, top_k, kwargs, "activation", False)


def check_checkpointed_replay(gate, top_k, kwargs, recompute, use_reentrant):
    """Two micro-batches, each forward then backward: a checkpointed layer's recompute takes its own
    forward's entry (not the next one); outputs and gradients equal those without checkpointing."""
    rollout = make_layer(gate, top_k, kwargs, recompute=recompute).eval()
    xs = [inputs(seed=s) for s in (7, 8)]
    trace = recorded(rollout, *xs)
    trainer = perturbed(rollout).train()
    plain = copy.deepcopy(trainer)

    def run(module, ckpt):
        outs = []
        with fmoe.replay_routing(module, trace):
            for x in xs:
                x = x.clone().requires_grad_(True)
                torch.manual_seed(3)        # the same noise in both runs (checkpointing replays it)
                out = module(x) if ckpt is None else checkpoint(module, x, use_reentrant=ckpt)
                (out * out).sum().backward()
                outs.append((out.detach(), x.grad))
        return outs, {n: p.grad for n, p in module.named_parameters()}

    (outs_p, grads_p), (outs_c, grads_c) = run(plain, None), run(trainer, use_reentrant)
    for (out_p, dx_p), (out_c, dx_c) in zip(outs_p, outs_c):
        torch.testing.assert_close(out_c, out_p, rtol=0, atol=0)
        torch.testing.assert_close(dx_c, dx_p, rtol=1e-6, atol=1e-7)
    for n in grads_p:
        torch.testing.assert_close(grads_c[n], grads_p[n], rtol=1e-6, atol=1e-7, msg=lambda m: f"{n}: {m}")


def test_record_under_checkpointing_records_each_forward_once():
    layer = make_layer("naive", 2, {}).train()
    with fmoe.record_routing(layer) as trace:
        x = inputs().requires_grad_(True)
        checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert len(trace[""]) == 1


# --- the oracle: a per-token loop over the recorded experts, float64 ----------------------------------

def reference_weights(gate, logits_E, experts):
    """One token's combine weights for its recorded `experts` (-1: none), as the gate's formula reads."""
    live = [e for e in experts if e >= 0]
    if gate.softmax_after_topk:
        weights = torch.softmax(torch.stack([logits_E[e] for e in live]), 0)
    else:
        scores_E = torch.softmax(logits_E, 0) if gate.score == "softmax" else torch.sigmoid(logits_E)
        weights = torch.stack([scores_E[e] for e in live])
        if gate.norm_topk_prob:
            weights = weights / weights.sum()
    return dict(zip(live, weights * gate.routed_scaling_factor))


def per_token_replay(layer, x_TD, idx_TK):
    rows = []
    router = layer.gate.gate.proj
    for t in range(x_TD.shape[0]):
        logits_E = x_TD[t] @ router.weight.T + (router.bias if router.bias is not None else 0.0)
        weights = reference_weights(layer.gate, logits_E, idx_TK[t].tolist())
        rows.append(sum((w * layer.experts.expert_forward(e, x_TD[t:t + 1])[0] for e, w in weights.items()),
                        torch.zeros(D, dtype=x_TD.dtype)))
    return torch.stack(rows)


ORACLE = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "granitemoe"]


@pytest.mark.parametrize("preset", ORACLE)
def test_replayed_gradients_equal_the_per_token_loop(preset):
    layer = make_layer(preset, 2, {}).double().train()
    x = inputs(n=6, dtype=torch.float64)
    idx_TK = torch.tensor([[3, 1], [0, 7], [5, -1], [2, 6], [-1, 4], [1, 0]])
    trace = fmoe.RoutingTrace({"": [idx_TK]})
    params = [layer.gate.gate.proj.weight, layer.experts.w1_eDF, layer.experts.w2_eFD]
    results = []
    for run in (lambda x: per_token_replay(layer, x, idx_TK), layer):
        x_in = x.clone().requires_grad_(True)
        with fmoe.replay_routing(layer, trace):
            out = run(x_in)
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        results.append((out, torch.autograd.grad((out * probe).sum(), [x_in] + params)))
    (out_r, grads_r), (out_l, grads_l) = results
    torch.testing.assert_close(out_l, out_r, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(["x", "router", "w1", "w2"], grads_l, grads_r):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_replayed_layer_passes_gradcheck():
    """Numerical against analytical gradients of x and the router under replay: the choice holds still
    however the router moves."""
    layer = make_layer("qwen3_moe", 2, {}).double().train()
    x = inputs(n=3, dtype=torch.float64).requires_grad_(True)
    weight = layer.gate.gate.proj.weight.detach().clone().requires_grad_(True)
    idx_TK = torch.tensor([[3, 1], [0, -1], [5, 2]])
    trace = fmoe.RoutingTrace({"": [idx_TK] * 400})

    def run(x, weight):
        return torch.func.functional_call(layer, {"gate.gate.proj.weight": weight}, (x,))
    with fmoe.replay_routing(layer, trace):
        assert torch.autograd.gradcheck(run, (x, weight))


def test_balance_losses_and_load_count_the_replayed_choice():
    from fmoe.gates.balance_losses import switch_loss

    layer = make_layer("router", 2, {"aux_loss": "switch", "aux_loss_coef": 1.0})
    x = inputs(n=6)
    with torch.no_grad():
        logits_TE = layer.gate.gate(x)
    worst_TK = torch.topk(-logits_TE, 2).indices         # the experts the router likes least
    with fmoe.replay_routing(layer, fmoe.RoutingTrace({"": [worst_TK]})):
        out = layer(x)
    torch.testing.assert_close(layer.aux_loss, switch_loss(logits_TE, 2, chosen_TK=worst_TK))
    assert not torch.allclose(layer.aux_loss, switch_loss(logits_TE, 2))
    assert torch.equal(layer.routing_stats["tokens_per_expert"], count(worst_TK))
    assert out.shape == x.shape


# --- gradient accumulation, several ranks, save / load ------------------------------------------------

def test_split_trace_replays_micro_batches_as_the_whole_batch():
    rollout = make_layer("mixtral", 2, {}).eval()
    x = inputs(n=12)
    trace = recorded(rollout, x)
    whole, parts = perturbed(rollout).train(), perturbed(rollout).train()
    with fmoe.replay_routing(whole, trace):
        out = whole(x)
    pieces = []
    for micro, x_mb in zip(trace.split(4), x.split(4)):
        assert len(micro[""]) == 1 and micro[""][0].shape == (4, 2)
        with fmoe.replay_routing(parts, micro):
            pieces.append(parts(x_mb))
    # fp32's tolerance: a GEMM over 4 rows may round otherwise than over 12 (the CPU's blocking differs);
    # one expert chosen otherwise would move an output by about its own size.
    torch.testing.assert_close(torch.cat(pieces), out)


def test_each_of_2_ranks_replays_its_tokens_as_one_process_and_megatron_names_layers_globally():
    """The slot and rank exchanges; in the same processes (one start-up), a Megatron layer names itself in a
    trace by its global layer number, so a later pipeline stage finds its layers in a whole model's trace."""
    has_megatron = importlib.util.find_spec("megatron") is not None
    run_ranks(replay_workers.check_replay_matches_single_process, 2, ("slot", "rank"), has_megatron)


@pytest.mark.skipif(not ALL_MODES, reason="4 processes on this CPU: FMOE_TEST_ALL_MODES=1")
def test_each_of_4_ranks_replays_its_tokens_as_one_process_with_the_rank_exchange():
    run_ranks(replay_workers.check_replay_matches_single_process, 4, ("rank",), False)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_save_and_load_round_trip(tmp_path, suffix):
    model = torch.nn.Sequential(make_layer("naive", 2, {}), make_layer("gshard", 2, {}, seed=1)).train()
    with fmoe.record_routing(model) as trace:
        model(inputs())
        model(inputs(n=5))
    path = tmp_path / f"trace{suffix}"
    trace.save(path)
    loaded = fmoe.RoutingTrace.load(path)
    assert loaded.names == ["0", "1"]
    for name in trace.names:
        assert len(loaded[name]) == 2
        for a, b in zip(loaded[name], trace[name]):
            assert a.dtype == torch.long and torch.equal(a, b)


def test_load_refuses_a_file_that_is_not_a_trace_or_of_another_version(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not an fmoe routing trace"):
        fmoe.RoutingTrace.load(tmp_path / "other.pt")
    torch.save({"format": "fmoe.routing_trace", "version": 99, "layers": [], "entries": []}, tmp_path / "new.pt")
    with pytest.raises(ValueError, match="version 99"):
        fmoe.RoutingTrace.load(tmp_path / "new.pt")


# --- bad input: one clear line, nothing changed -------------------------------------------------------

def unchanged(layer, x):
    """The layer still routes on its own, as before the refused call."""
    assert layer.gate.routing_mode is None
    with Choices(layer) as seen, torch.no_grad():
        layer(x)
    return seen[0]


def test_a_trace_for_other_layers_is_refused():
    model = torch.nn.Sequential(make_layer("naive", 2, {}), make_layer("naive", 2, {}, seed=1))
    trace = fmoe.RoutingTrace({"0": [torch.zeros(T, 2, dtype=torch.long)], "extra": []})
    before = unchanged(model[1], inputs())
    with pytest.raises(ValueError, match=r"no entries for layers \['1'\]; it holds \['0', 'extra'\]"):
        with fmoe.replay_routing(model, trace):
            pass
    assert torch.equal(unchanged(model[1], inputs()), before)


def test_an_index_outside_the_layers_experts_or_a_wrong_top_k_is_refused():
    layer = make_layer("naive", 2, {})
    for idx, message in ((torch.full((T, 2), E), r"ids must be in \[-1, 8\).*from 8 to 8"),
                         (torch.full((T, 2), -2), r"from -2 to -2"),
                         (torch.zeros(T, 3, dtype=torch.long), "3 experts a token, the gate routes top_k=2")):
        with pytest.raises(ValueError, match=message):
            with fmoe.replay_routing(layer, fmoe.RoutingTrace({"": [idx.long()]})):
                pass
        unchanged(layer, inputs())


def test_a_token_count_differing_from_the_forwards_is_refused_before_anything_moves():
    layer = make_layer("naive", 2, {})
    trace = recorded(layer, inputs(n=T))
    with fmoe.replay_routing(layer, trace):
        with pytest.raises(ValueError, match=r"layer '' routes 4 tokens in forward 1, the trace recorded 10 there"):
            layer(inputs(n=4))
        layer(inputs(n=T))          # the entry is still the next one
    unchanged(layer, inputs())


def test_an_exhausted_trace_is_refused():
    layer = make_layer("naive", 2, {})
    trace = recorded(layer, inputs())
    with fmoe.replay_routing(layer, trace):
        layer(inputs())
        with pytest.raises(ValueError, match="trace of layer '' is exhausted: it holds 1 forwards, this is forward 2"):
            layer(inputs())
    unchanged(layer, inputs())


def test_record_and_replay_cannot_nest_on_one_model():
    layer = make_layer("naive", 2, {})
    trace = recorded(layer, inputs())
    with fmoe.record_routing(layer) as outer:
        with pytest.raises(ValueError, match="already under record_routing: record and replay cannot nest"):
            with fmoe.replay_routing(layer, trace):
                pass
        with pytest.raises(ValueError, match="already under record_routing"):
            with fmoe.record_routing(layer):
                pass
        layer(inputs())
    assert len(outer[""]) == 1
    unchanged(layer, inputs())


def test_a_gate_routing_in_its_own_forward_is_refused_for_replay():
    class ForwardGate(fmoe.NaiveGate):
        def forward(self, x):
            return super().forward(x)
    layer = fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=H, gate=ForwardGate)
    trace = recorded(layer, inputs())
    with pytest.raises(ValueError, match="routes in its own forward"):
        with fmoe.replay_routing(layer, trace):
            pass


# --- integrations ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "phimoe"])
def test_hf_trace_from_router_logits_equals_the_recorded_one_and_replays(family):
    import fmoe.integrations.hf
    from tests.hf_models import tiny, tokens

    hf = tiny(family)
    model = fmoe.integrations.hf.convert(copy.deepcopy(hf))
    ids = tokens()
    with torch.no_grad():
        trace = fmoe.integrations.hf.trace_from_router_logits(model, hf(ids, output_router_logits=True).router_logits)
        with fmoe.record_routing(model) as recorded_trace:
            model(ids)
    assert trace.names == recorded_trace.names
    for name in trace.names:
        assert torch.equal(trace[name][0], recorded_trace[name][0])
    trainer = model.train()
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if ".gate." in name:
                p.add_(torch.randn_like(p))
    layers = [m for m in trainer.modules() if isinstance(m, fmoe.FMoE)]
    with fmoe.replay_routing(trainer, trace), Choices(*layers) as seen:
        trainer(ids, labels=ids).loss.backward()
    for got, want in zip(seen, (trace[name][0] for name in trace.names)):
        assert torch.equal(got, want)


def test_generate_steps_joined_replay_in_one_forward_over_the_sequences():
    import fmoe.integrations.hf
    from tests.hf_models import tiny, tokens

    model = fmoe.integrations.hf.convert(tiny("qwen3_moe"))
    ids = tokens(batch=2, length=5)
    with fmoe.record_routing(model) as trace, torch.no_grad():
        sequences = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                                   pad_token_id=0)
    assert [entry.shape[0] for entry in trace[trace.names[0]]] == [10, 2, 2]
    whole = trace.joined(2)
    first = trace[trace.names[0]]
    assert torch.equal(whole[trace.names[0]][0].view(2, 7, 2),
                       torch.cat([first[0].view(2, 5, 2), first[1].view(2, 1, 2), first[2].view(2, 1, 2)], 1))
    layers = [m for m in model.modules() if isinstance(m, fmoe.FMoE)]
    with fmoe.replay_routing(model.train(), whole), Choices(*layers) as seen:
        model(sequences[:, :-1], labels=sequences[:, :-1]).loss.backward()
    assert all(torch.equal(got, whole[name][0]) for got, name in zip(seen, whole.names))
    with pytest.raises(ValueError, match="not whole steps of batch_size=3"):
        trace.joined(3)


def test_example_prints_disagreement_without_replay_and_none_with_it(capsys):
    runpy.run_path(os.path.join(ROOT, "examples", "router_replay.py"), run_name="__main__")
    out = capsys.readouterr().out
    without = float(out.split("without replay:")[1].split()[0])
    with_replay = float(out.split("with replay:")[1].split()[0])
    assert without > 0 and with_replay == 0, out
