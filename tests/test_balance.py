"""Load balancing as DeepSeek-V3, Qwen3 and Megatron-Core train it: the aux-loss-free bias moved once
per optimizer step from the step's whole load, and the sequence-wise and global-batch losses."""
import copy
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import fmoe
from fmoe.gates.balance_losses import global_loss, normalised_scores, sequence_loss
from fmoe.gates.router import RouterGate
from tests.dist_utils import run_ranks

D, E = 8, 8
SPEED = 0.05


def balanced_model(bias_update="step", speed=SPEED, balance_group="world", gate="router"):
    """`gate="balanced"`: BalancedGate, the same routing as this RouterGate's."""
    torch.manual_seed(0)
    gate_kwargs = dict(bias_update_speed=speed, gate_bias=True)
    if gate == "router":
        gate_kwargs.update(score="sigmoid", norm_topk_prob=True, selection_bias="updated", bias_update=bias_update,
                           balance_group=balance_group)
    model = nn.Sequential(nn.Linear(D, D), fmoe.FMoETransformerMLP(
        num_expert=E, d_model=D, d_hidden=16, top_k=2, gate=gate, gate_kwargs=gate_kwargs))
    with torch.no_grad():      # a skewed router, so the load is far from even
        model[1].gate.gate.proj.bias.copy_(torch.linspace(1.0, -1.0, E))
    return model


def micro_batches(n=4, tokens=16, seed=1):
    """Inputs that need grad, as a layer's input does inside a model (reentrant checkpoint needs it)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, D, generator=g).requires_grad_() for _ in range(n)]


def chosen_load(model, xs):
    """The reference: each expert's slots over `xs`, routed one token at a time with the current bias."""
    gate = model[1].gate
    load = torch.zeros(E)
    with torch.no_grad():
        for x in xs:
            h = model[0](x)
            for t in range(h.shape[0]):
                scores = torch.sigmoid(gate.gate(h[t:t + 1]))[0] + gate.e_score_correction_bias
                for e in torch.topk(scores, 2).indices.tolist():
                    load[e] += 1
    return load


def expected_bias(bias, load, speed=SPEED):
    return bias + speed * torch.sign(load.mean() - load)


def train_step(model, optimizer, xs):
    for x in xs:
        (model(x).square().mean() + fmoe.collect_aux_loss(model)).backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("recompute", [None, "reentrant", "non-reentrant"])
def test_bias_moves_once_per_step_by_the_summed_load_of_its_micro_batches(recompute):
    model = balanced_model().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)     # lr 0: only the bias changes the routing
    fmoe.register_bias_update(model, optimizer)
    bias = model[1].gate.e_score_correction_bias
    for step in range(3):
        xs = micro_batches(seed=step)
        before = bias.clone()
        want = expected_bias(before, chosen_load(model, xs))
        for x in xs:                # forwards and backwards leave the bias alone
            y = model(x) if recompute is None else checkpoint(model, x, use_reentrant=recompute == "reentrant")
            y.square().mean().backward()
            assert torch.equal(bias, before)
        optimizer.step()
        optimizer.zero_grad()
        torch.testing.assert_close(bias, want, rtol=0, atol=1e-7)
        assert not torch.equal(bias, before)


def test_accumulated_micro_batches_move_the_bias_as_one_big_batch():
    one, many = balanced_model().train(), balanced_model().train()
    opt_one, opt_many = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (one, many))
    fmoe.register_bias_update(one, opt_one)
    fmoe.register_bias_update(many, opt_many)
    for step in range(3):
        xs = micro_batches(seed=step)
        train_step(one, opt_one, [torch.cat(xs).detach()])
        for x in xs:
            (many(x).square().mean() / len(xs)).backward()
        opt_many.step()
        opt_many.zero_grad()
        torch.testing.assert_close(many[1].gate.e_score_correction_bias, one[1].gate.e_score_correction_bias)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_recompute_routes_as_its_forward_and_gives_the_same_gradients(use_reentrant):
    plain, ckpt = balanced_model(speed=0.05).train(), balanced_model(speed=0.05).train()
    for model in (plain, ckpt):
        model[1].gate.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, E))
        fmoe.register_bias_update(model, torch.optim.SGD(model.parameters(), lr=0.0))
    seen = {}
    for name, model in (("plain", plain), ("ckpt", ckpt)):
        routes = []
        original = model[1].gate.route

        def recording(x, original=original, routes=routes):
            out = original(x)
            routes.append(out[0].clone())
            return out
        model[1].gate.route = recording
        x = micro_batches(1, 32)[0]
        y = model(x) if name == "plain" else checkpoint(model, x, use_reentrant=use_reentrant)
        y.square().mean().backward()
        seen[name] = (routes, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    routes, grads = seen["ckpt"]
    assert len(routes) == 2 and torch.equal(routes[0], routes[1])       # forward and recompute
    assert torch.equal(routes[0], seen["plain"][0][0])
    for name, g in seen["plain"][1].items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-7)
    assert ckpt[1].gate.step_load_E.sum() == 32 * 2         # counted once, not again in the recompute


@pytest.mark.parametrize("gate", ["router", "balanced"])
@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_no_grad_training_forward_and_eval_do_not_count_toward_the_step(gate, no_grad):
    model = balanced_model(gate=gate)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    fmoe.register_bias_update(model, optimizer)
    bias = model[1].gate.e_score_correction_bias
    with no_grad():
        model.train()(micro_batches(1)[0])
        model.eval()(micro_batches(1)[0])
    optimizer.step()
    assert bias.abs().sum() == 0
    xs = micro_batches(2, seed=5)
    want = expected_bias(bias.clone(), chosen_load(model, xs[:1]))     # the graded forward's load alone
    model.train()(xs[0]).square().mean().backward()
    with no_grad():
        model(xs[1])
    optimizer.step()
    torch.testing.assert_close(bias, want, rtol=0, atol=1e-7)


def test_forward_mode_moves_at_the_next_forward_from_the_one_before():
    model = balanced_model(bias_update="forward").train()
    bias = model[1].gate.e_score_correction_bias
    xs = micro_batches(3)
    model(xs[0])
    assert bias.abs().sum() == 0
    want = expected_bias(bias.clone(), chosen_load(model, xs[:1]))
    model(xs[1])
    torch.testing.assert_close(bias, want, rtol=0, atol=1e-7)


def test_register_bias_update_finds_wrapped_optimizers_and_replaces_itself():
    model = balanced_model().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

    class Wrapper:                  # DeepSpeed's and Megatron's keep the torch optimizer in .optimizer
        def __init__(self, inner):
            self.optimizer = inner
    fmoe.register_bias_update(model, Wrapper(optimizer))
    fmoe.register_bias_update(model, optimizer)
    bias = model[1].gate.e_score_correction_bias
    xs = micro_batches(1)
    want = expected_bias(bias.clone(), chosen_load(model, xs))
    model(xs[0]).sum().backward()
    optimizer.step()
    torch.testing.assert_close(bias, want, rtol=0, atol=1e-7)       # once, not twice
    with pytest.raises(ValueError, match="optimizer"):
        fmoe.register_bias_update(model, object())
    with pytest.raises(ValueError, match="no gate"):
        fmoe.register_bias_update(nn.Linear(2, 2), optimizer)


def test_unregistered_step_bias_warns_once():
    model = balanced_model().train()
    with pytest.warns(UserWarning, match="register_bias_update"):
        model(micro_batches(1)[0])


# --- two ranks ------------------------------------------------------------------------------------

def uneven_micro_batches_worker(rank, world):
    """Rank 0 runs 3 micro-batches a step, rank 1 runs 1: the bias moves by the load of all 4."""
    model = balanced_model().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    fmoe.register_bias_update(model, optimizer)
    reference = balanced_model(balance_group="local")
    for step in range(2):
        xs = micro_batches(4, seed=10 + step)
        mine = xs[:3] if rank == 0 else xs[3:]
        want = expected_bias(model[1].gate.e_score_correction_bias.clone(), chosen_load(reference, xs))
        for x in mine:
            model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.testing.assert_close(model[1].gate.e_score_correction_bias, want, rtol=0, atol=1e-7)
        reference[1].gate.e_score_correction_bias.copy_(want)


def test_two_ranks_with_different_micro_batch_counts_agree():
    run_ranks(uneven_micro_batches_worker, 2)


def stalled_peer_worker(rank, world):
    os.environ["FMOE_COLLECTIVE_TIMEOUT"] = "3"
    model = balanced_model().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    fmoe.register_bias_update(model, optimizer)
    model(micro_batches(1)[0]).sum().backward()
    if rank == 1:
        time.sleep(8)               # asleep past the timeout: rank 0 must give up, naming the gate
        return
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"1\.gate.*bias.*FMOE_COLLECTIVE_TIMEOUT"):
        optimizer.step()
    assert time.monotonic() - started < 7


def test_bias_update_collective_is_bounded_and_names_the_gate():
    run_ranks(stalled_peer_worker, 2)


# --- the losses against their formulas ---------------------------------------------------------------

def sequence_loss_reference(logits_BSE, score, top_k):
    """DeepSeek-V3's sequence-wise loss, one sequence and one expert at a time."""
    B, S, E_ = logits_BSE.shape
    total = 0.0
    for b in range(B):
        s = normalised_scores(logits_BSE[b], score)
        chosen = torch.topk(s, top_k, dim=-1).indices
        seq = 0.0
        for e in range(E_):
            f = E_ / (top_k * S) * float((chosen == e).sum())
            seq = seq + f * s[:, e].mean()
        total = total + seq
    return total / B


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_sequence_loss_equals_the_formula_and_megatron(score):
    torch.manual_seed(0)
    B, S, K = 3, 5, 2
    logits = torch.randn(B, S, E, dtype=torch.float64, requires_grad=True)
    got = sequence_loss(normalised_scores(logits, score).transpose(0, 1), K)
    want = sequence_loss_reference(logits, score, K)
    torch.testing.assert_close(got, want)
    g_got, = torch.autograd.grad(got, logits)
    g_want, = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g_got, g_want)
    # Megatron-Core's seq_aux_loss: its token order is [S, B] and it reshapes the scores to [S, B * E].
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    scores_SBE = normalised_scores(logits.detach().transpose(0, 1), score)
    routing_map = torch.zeros_like(scores_SBE, dtype=torch.bool).scatter(-1, torch.topk(scores_SBE, K).indices, True)
    megatron = moe_utils.switch_load_balancing_loss_func(
        scores_SBE.reshape(S, B * E), routing_map.reshape(S, B * E).sum(0), S, K, E, 1.0) / B
    torch.testing.assert_close(got.detach(), megatron)


def test_sequence_loss_gradcheck():
    logits = torch.randn(4, 2, E, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda l: sequence_loss(torch.softmax(l, -1), 2), (logits,))
    fraction = torch.rand(E, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda l: global_loss(torch.softmax(l, -1), fraction),
                                    (logits.reshape(8, E).detach().requires_grad_(),))


@pytest.mark.parametrize("layout", ["batch_first", "sequence_first", "seq_len"])
def test_layer_finds_its_sequences(layout):
    torch.manual_seed(0)
    B, S = 3, 4
    kwargs = dict(aux_loss="sequence", aux_loss_coef=0.5, score="sigmoid")
    if layout == "seq_len":
        kwargs["seq_len"] = S
    layer = fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=16, top_k=2, gate="router",
                                    gate_kwargs=kwargs).train()
    x_BSD = torch.randn(B, S, D)
    if layout == "sequence_first":
        layer.sequence_first = True
        layer(x_BSD.transpose(0, 1).contiguous())
    elif layout == "seq_len":
        layer(x_BSD.reshape(B * S, D))
    else:
        layer(x_BSD)
    logits_BSE = layer.gate.gate(x_BSD.reshape(-1, D)).reshape(B, S, E)
    torch.testing.assert_close(layer.aux_loss, 0.5 * sequence_loss_reference(logits_BSE, "sigmoid", 2))


def test_losses_combine_with_their_own_coefficients():
    torch.manual_seed(0)
    x = torch.randn(12, D)
    coefs = {"switch": 0.1, "sequence": 0.01, "global": 0.001}
    both = RouterGate(D, E, top_k=2, aux_loss=tuple(coefs), aux_loss_coef=coefs, z_loss_coef=0.2).train()
    total = both.routing(x).aux_loss
    parts = 0.2 * torch.logsumexp(both.gate(x), -1).square().mean()
    for name, coef in coefs.items():
        alone = RouterGate(D, E, top_k=2, aux_loss=name, aux_loss_coef=coef).train()
        alone.load_state_dict(both.state_dict())
        parts = parts + alone.routing(x).aux_loss
    torch.testing.assert_close(total, parts)


@pytest.mark.parametrize("kwargs,match", [
    (dict(aux_loss="gshard"), "aux_loss"),
    (dict(aux_loss=("switch", "switch")), "aux_loss"),
    (dict(aux_loss=("switch", "global"), aux_loss_coef={"switch": 0.1}), "aux_loss_coef"),
    (dict(aux_loss="switch", aux_loss_coef=-1.0), "aux_loss_coef"),
    (dict(bias_update="epoch"), "bias_update"),
    (dict(balance_group="node"), "balance_group"),
    (dict(seq_len=0), "seq_len"),
])
def test_bad_balance_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RouterGate(D, E, top_k=2, **kwargs)


def global_loss_reference(gate, xs, K=2):
    """Megatron-Core's global_aux_loss on one rank: f from the running mean of the step's counts."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    losses, counts = [], torch.zeros(E)
    for m, x in enumerate(xs, 1):
        scores = torch.softmax(gate.gate(x), -1)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, torch.topk(scores, K).indices, True)
        counts = counts + routing_map.sum(0)
        losses.append(moe_utils.switch_load_balancing_loss_func(scores, counts / m, x.shape[0], K, E, 0.01))
    return losses


def test_global_loss_counts_the_step_and_restarts_with_it():
    torch.manual_seed(0)
    model = nn.Sequential(fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=16, top_k=2, gate="router",
                                                  gate_kwargs=dict(aux_loss="global", aux_loss_coef=0.01)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    fmoe.register_bias_update(model, optimizer)
    gate = model[0].gate
    for step in range(2):
        xs = micro_batches(3, seed=step)
        want = global_loss_reference(gate, xs)
        for x, loss in zip(xs, want):
            model.train()(x)
            torch.testing.assert_close(model[0].aux_loss, loss)
            model[0].aux_loss.backward()
        optimizer.step()


def global_loss_worker(rank, world):
    torch.manual_seed(0)
    gate = RouterGate(D, E, top_k=2, aux_loss="global", aux_loss_coef=1.0).train()
    x_all = micro_batches(1, 8 * world)[0]
    mine = x_all[rank * 8:(rank + 1) * 8]
    scores_all = torch.softmax(gate.gate(x_all), -1)
    counts = torch.zeros(E).scatter_add_(0, torch.topk(scores_all, 2).indices.reshape(-1), torch.ones(16 * world))
    want = E * (counts / counts.sum() * torch.softmax(gate.gate(mine), -1).mean(0)).sum()
    torch.testing.assert_close(gate.routing(mine).aux_loss, want)


def test_global_loss_counts_over_the_ranks():
    run_ranks(global_loss_worker, 2)


def test_checkpoint_keeps_counts_out_of_the_state_dict():
    model = balanced_model()
    gate = RouterGate(D, E, aux_loss="global", selection_bias="updated")
    assert "step_load_E" not in gate.state_dict() and "global_slots_E" not in gate.state_dict()
    assert "1.gate.e_score_correction_bias" in model.state_dict()
    assert copy.deepcopy(gate).step_load_E.dtype == torch.long


# --- the integrations register the hook -------------------------------------------------------------

def counting_end_step(monkeypatch):
    import fmoe.load_balancing as lb
    calls = []
    original = lb.end_step
    monkeypatch.setattr(lb, "end_step", lambda model: calls.append(1) or original(model))
    return calls


def test_fmoe_train_moves_the_bias_once_per_step(tmp_path, monkeypatch):
    from tests.test_train import run_train
    calls = counting_end_step(monkeypatch)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    assert run_train(corpus, tmp_path / "run", 3, "--gate", "balanced", "--log", "none") == 0
    assert len(calls) == 3


def test_hf_trainer_callback_moves_the_bias_once_per_optimizer_step(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    import fmoe.integrations.hf
    from tests import hf_models
    calls = counting_end_step(monkeypatch)
    torch.manual_seed(0)
    model = fmoe.integrations.hf.convert(transformers.AutoModelForCausalLM.from_config(hf_models.config("qwen3_moe")),
                            selection_bias="updated")
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(1, hf_models.VOCAB, (8, 16))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                                          gradient_accumulation_steps=2, report_to=[], save_strategy="no",
                                          use_cpu=True, disable_tqdm=True, learning_rate=1e-3)
    transformers.Trainer(model=model, args=args, train_dataset=data,
                         callbacks=[fmoe.integrations.hf.BiasUpdateCallback()]).train()
    assert len(calls) == 2
    assert any(g.e_score_correction_bias.any() for g in model.modules() if hasattr(g, "e_score_correction_bias"))
