"""Worker bodies for FasterMoE shadowing and scheduling: on and off must give the same numbers."""
import torch
import torch.distributed as dist
from torch import nn

import fmoe
from fmoe.distributed.shadow import ShadowPolicy
from fmoe.perf.perfmodel import PerfModel

D, H = 8, 16


class FixedShadow(ShadowPolicy):
    """Shadows the given experts every step, whatever the model says."""

    def __init__(self, experts, overlap=True):
        super().__init__(PerfModel(D, H), overlap=overlap)
        self.experts = experts

    def choose(self, counts_E, world_size, group=None):
        self.gather_counts(counts_E, world_size, group)     # still a collective, as in real use
        return list(self.experts)


class TinyExpert(nn.Module):
    """A user expert class (FastMoE's `expert=`): a LayerNorm'd two-layer MLP."""

    def __init__(self, d_model):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.fc1, self.fc2 = nn.Linear(d_model, H), nn.Linear(H, d_model)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(self.norm(x))))


def build(world, e, top_k, hot, expert=None, activation="gelu", **kw):
    torch.manual_seed(0)
    if expert is not None:
        layer = fmoe.FMoE(num_expert=e, d_model=D, top_k=top_k, world_size=world, expert=expert, **kw)
    else:
        layer = fmoe.FMoETransformerMLP(num_expert=e, d_model=D, d_hidden=H, top_k=top_k, world_size=world,
                                        activation=activation, **kw)
    with torch.no_grad():
        bias = torch.zeros(e * world)
        bias[hot] = 3.0
        layer.gate.gate.proj.bias.copy_(bias)
    return layer


def assert_same_results(first, second, ctx: str = ""):
    """Two runs' (tensors, {name: gradient}) equal to 1e-5: the tensors in order, the same gradients."""
    (t0, g0), (t1, g1) = first, second
    for a, b in zip(t0, t1, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx}: {m}")
    assert g0.keys() == g1.keys(), (ctx, g0.keys(), g1.keys())
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx} {n}: {m}")


def compare_variants(rank, world, top_k, hot, make_variant, make_plain=build, exact=False):
    """The plain expert-parallel layer (`make_plain`) against `make_variant(...)`: outputs, all
    gradients, and parameters after one SGD step; `exact`: bitwise."""
    e = 2
    results = []
    for variant in (False, True):
        layer = (make_variant if variant else make_plain)(world, e, top_k, hot)
        # Rank r's experts start from the same weights in both variants.
        torch.manual_seed(10 + rank)
        with torch.no_grad():
            for p in layer.experts.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(12 + 3 * rank, D, generator=g).requires_grad_(True)
        opt = torch.optim.SGD(layer.parameters(), lr=0.5)
        out = layer(x)
        (out * torch.randn(out.shape, generator=g)).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        opt.step()
        params = {n: p.detach().clone() for n, p in layer.named_parameters()}
        results.append((out.detach(), x.grad, grads, params, layer))
    (out0, dx0, g0, p0, _), (out1, dx1, g1, p1, layer1) = results
    ctx = f"rank {rank}/{world} top{top_k} hot{hot}"
    if exact:
        assert torch.equal(out1, out0) and torch.equal(dx1, dx0), ctx
        assert g0.keys() == g1.keys() and all(torch.equal(g1[n], g0[n]) for n in g0), ctx
        assert all(torch.equal(p1[n], p0[n]) for n in p0), ctx
        return layer1
    torch.testing.assert_close(out1, out0, atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx} out: {m}")
    torch.testing.assert_close(dx1, dx0, atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx} dx: {m}")
    assert g0.keys() == g1.keys(), (ctx, g0.keys(), g1.keys())
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx} grad {n}: {m}")
    for n in p0:
        torch.testing.assert_close(p1[n], p0[n], atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx} param {n}: {m}")
    return layer1


def check_shadowing_equals_plain(rank, world):
    E = 2 * world
    # Two owners; and two experts of one owner, out of order (the stacked views of one buffer).
    for top_k, hot in ((1, [0]), (2, [0, E - 1]), (2, [1, E - 2]), (2, [1, 0])):
        layer = compare_variants(rank, world, top_k, hot,
                                 lambda w, e, k, h: build(w, e, k, h, shadow=FixedShadow(h)))
        assert layer.num_dropped == 0


def check_policy_shadows_a_hot_expert(rank, world):
    """The real policy, with a model where shadowing pays, picks the hot expert and the layer still
    equals the plain one."""
    policy = ShadowPolicy(PerfModel(D, H, flops=1e6, net_bandwidth=1e12))
    chosen = []

    class Recording(ShadowPolicy):
        def choose(self, counts_E, world_size, group=None):
            chosen.append(policy.choose(counts_E, world_size, group))
            return chosen[-1]

    compare_variants(rank, world, 1, [0], lambda w, e, k, h: build(w, e, k, h, shadow=Recording(policy.model)))
    assert chosen and 0 in chosen[0], chosen
    everyone = [None] * world
    dist.all_gather_object(everyone, chosen[0])
    assert all(c == chosen[0] for c in everyone), everyone


def check_schedule_equals_plain(rank, world):
    E = 2 * world
    for group_size in (1, 2):
        for top_k, hot, shadow in ((2, [], False), (1, [0], False), (2, [0, E - 1], True)):
            def make(w, e, k, h):
                return build(w, e, k, h, schedule=True, schedule_group_size=group_size,
                             shadow=FixedShadow(h) if shadow else False)
            compare_variants(rank, world, top_k, hot, make)


def check_overlap_is_bitwise_blocking(rank, world):
    """Overlapped pulls and pushes give exactly the numbers of blocking ones."""
    E = 2 * world
    for top_k, hot, kw in ((1, [0], {}), (2, [0, E - 1], {"expert": TinyExpert}),
                           (2, [0, E - 1], {"schedule": True, "schedule_group_size": 1})):
        compare_variants(rank, world, top_k, hot,
                         lambda w, e, k, h: build(w, e, k, h, shadow=FixedShadow(h, overlap=True), **kw),
                         lambda w, e, k, h: build(w, e, k, h, shadow=FixedShadow(h, overlap=False), **kw),
                         exact=True)


def check_any_expert_shadowing_equals_plain(rank, world):
    """User expert classes and gated (swiglu) experts, with and without the smart schedule."""
    E = 2 * world
    for top_k, hot, kw in ((1, [0], {"expert": TinyExpert}), (2, [1, E - 1], {"activation": "swiglu"}),
                           (2, [1, E - 1], {"expert": TinyExpert, "schedule": True, "schedule_group_size": 1}),
                           (1, [0], {"activation": "swiglu", "schedule": True, "schedule_group_size": 2}),
                           (2, [1, 0], {"expert": TinyExpert}), (2, [1, 0], {"activation": "swiglu"})):
        compare_variants(rank, world, top_k, hot,
                         lambda w, e, k, h: build(w, e, k, h, shadow=FixedShadow(h), **kw),
                         lambda w, e, k, h: build(w, e, k, h, shadow=False, **kw))


def check_deepspeed_shadowing_equals_off(rank, world):
    """DeepSpeed ZeRO 0 and 2 (ep = world): two steps with shadowing equal two without, in outputs,
    gradients (ZeRO 0) and parameters."""
    import deepspeed
    import fmoe.integrations.deepspeed as fds
    groups = fds.setup_expert_parallel(world)
    hot = [0, 2 * world - 1]
    for stage in (0, 2):
        runs = []
        for shadow in (False, FixedShadow(hot)):
            layer = build(world, 2, 2, hot, shadow=shadow, moe_group=groups.moe_group)
            fds.mark_expert_params(layer)
            params = fds.moe_param_groups(layer)
            engine, *_ = deepspeed.initialize(
                # SGD: Adam would turn the last-bit differences of near-zero gradients (the two paths
                # sum in different orders) into steps of +-lr.
                model=layer, model_parameters=params, optimizer=torch.optim.SGD(params, lr=1e-1),
                config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
                        "zero_allow_untested_optimizer": True,
                        "steps_per_print": 10 ** 6})
            g = torch.Generator().manual_seed(rank)
            outs, grads = [], []
            for _ in range(2):
                x = torch.randn(10, D, generator=g)
                out = engine(x)
                engine.backward((out * torch.randn(out.shape, generator=g)).sum())
                if stage == 0:
                    grads.append([p.grad.clone() for p in layer.parameters()])
                engine.step()
                outs.append(out.detach())
            runs.append((outs, grads, [p.detach().clone() for p in layer.parameters()]))
        (o0, g0, p0), (o1, g1, p1) = runs
        for a, b in zip(o0 + sum(g0, []) + p0, o1 + sum(g1, []) + p1):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=lambda m: f"stage {stage} rank {rank}: {m}")


def check_megatron_shadowing_equals_off(rank, world):
    """A 2-layer Megatron-Core GPT with fmoe MLPs (expert parallel = world), trained with Megatron's
    DDP, Adam and schedules: two steps with the first and the last expert shadowed equal two without,
    in losses, grad norms, every gradient of the last step and every parameter after it."""
    from megatron.core import parallel_state

    from fmoe.integrations.megatron import training
    from tests.test_megatron import EXPERTS, batch, gpt

    runs = []
    for shadow in (None, FixedShadow([0, EXPERTS - 1])):      # the first and the last rank's experts
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        training.initialize(1, world, seed=7)       # the same initial weights in both runs
        model, optimizer = training.wrap(gpt(world, gate="naive", aux_loss_coeff=0.0, shadow=shadow), lr=1e-2)
        mlp = model.module.decoder.layers[0].mlp.moe
        assert (mlp.shadow_policy is None) == (shadow is None)
        shadow_rows, run_rows = [], mlp.dispatcher.run_rows

        def spy(x, plan, *rest):
            shadow_rows.append(plan.num_shadow_rows)
            return run_rows(x, plan, *rest)
        mlp.dispatcher.run_rows = spy
        steps = [training.train_step(model, optimizer, [batch(step, rank)]) for step in range(2)]
        # Shadowing on: rows really ran on a pulled copy of an expert at home (off, the lean
        # path runs the experts without run_rows).
        assert (bool(shadow_rows) and min(shadow_rows) > 0) == (shadow is not None), shadow_rows
        grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        runs.append((steps, grads, params))
    parallel_state.destroy_model_parallel()
    (s0, g0, p0), (s1, g1, p1) = runs
    assert s0 and torch.allclose(torch.tensor(s1), torch.tensor(s0), atol=1e-5, rtol=1e-5), (rank, s0, s1)
    for n in p0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-5, msg=lambda m: f"rank {rank} grad {n}: {m}")
        # Adam's step is about lr * sign(grad): gradients equal to 1e-7 may still move a parameter whose
        # gradient is near 0 a little differently, so parameters are held to 1% of the learning rate.
        torch.testing.assert_close(p1[n], p0[n], atol=1e-4, rtol=1e-5, msg=lambda m: f"rank {rank} param {n}: {m}")


def check_pulled_copies_are_freed(rank, world):
    """After each step's backward nothing of the pull stays alive: no pulled buffer, no link, and
    (the regression) no leak of a layer's parameters once the layer is gone."""
    import gc
    import weakref

    from fmoe.distributed import shadow
    pulls = []
    real_init = shadow.ShadowPull.__init__

    def spying_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        pulls.append([weakref.ref(self.link)] + [weakref.ref(b) for b in self.link.buffers])
    shadow.ShadowPull.__init__ = spying_init
    try:
        layer = build(world, 2, 1, [0], shadow=FixedShadow([0]))
        param = weakref.ref(layer.experts.w1_eDF)
        x = torch.randn(6, D, requires_grad=True)
        for _ in range(3):
            layer(x).sum().backward()
        gc.collect()
        assert len(pulls) == 3 and all(r() is None for refs in pulls for r in refs), \
            [[r() is None for r in refs] for refs in pulls]
        del layer
        gc.collect()
        assert param() is None, "the layer's parameters outlived it"
    finally:
        shadow.ShadowPull.__init__ = real_init


def check_calibration_measures_every_constant_alike_on_all_ranks(rank, world):
    """calibrate() on real ranks: every constant measured, finite, and the same on every rank."""
    import math

    from fmoe.perf.calibration import calibrate
    from fmoe.perf.simulate import CONSTANTS
    model = calibrate(PerfModel(64, 256), size=256, reps=3, tokens=128)
    values = [getattr(model, name) for name in CONSTANTS if name != "expert_seconds"]
    assert all(v is not None and math.isfinite(v) and v >= 0 for v in values), dict(zip(CONSTANTS, values))
    rows, seconds = zip(*model.expert_seconds)
    assert rows[0] == 0 and list(rows) == sorted(set(rows)) and all(math.isfinite(t) and t > 0 for t in seconds)
    values.append(model.expert_seconds)
    assert model.flops > 0 and model.net_bandwidth > 0 and model.pull_bandwidth > 0 and model.push_bandwidth > 0
    everyone = [None] * world
    dist.all_gather_object(everyone, values)
    assert all(v == everyone[0] for v in everyone), everyone


def check_kept_buffers_are_reused_and_never_shared(rank, world):
    """The layer's pool over several steps: shadowing with kept buffers equals the plain layer step
    after step, including two micro-batches whose forwards both run before either backward (the
    second must not get the first's buffers, still saved for its backward), and a later step reuses
    the very buffers an earlier one used."""
    E = 2 * world
    layers = []
    for shadow in (False, True):
        for module_list in (False, True):
            expert = TinyExpert if module_list else None
            layer = build(world, 2, 2, [1, 0, E - 1], expert=expert,
                          shadow=FixedShadow([1, 0, E - 1]) if shadow else False)
            torch.manual_seed(10 + rank)
            with torch.no_grad():
                for p in layer.experts.parameters():
                    p.copy_(torch.randn_like(p) * 0.3)
            layers.append(layer)
    seen = {}
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        xs = [torch.randn(10 + rank, D, generator=g) for _ in range(2)]
        for plain, shadowed in ((layers[0], layers[2]), (layers[1], layers[3])):
            results = []
            for layer in (plain, shadowed):
                layer.zero_grad(set_to_none=True)
                outs = [layer(x) for x in xs]                   # both forwards, then both backwards
                for out in outs:
                    (out * out).sum().backward()
                results.append(([o.detach() for o in outs], {n: p.grad.clone() for n, p in layer.named_parameters()
                                                              if p.grad is not None}))
            assert_same_results(*results, f"step {step}")
            pool = shadowed.shadow_buffers
            ptrs = {tag: sorted(b.data_ptr() for b in kept) for tag, kept in pool.buffers.items()}
            assert pool.nbytes > 0 and all(len(kept) <= pool.per_tag for kept in pool.buffers.values())
            key = id(shadowed)
            if key in seen:
                assert ptrs == seen[key], (step, ptrs, seen[key])     # the same buffers, step after step
            seen[key] = ptrs


def check_fit_times_takes_shadowings_cost_round_by_round(rank, world):
    """fit_times on real ranks: the probes' medians, and shadowing's added time from the on/off
    differences of each round, not from the difference of their medians."""
    from fmoe.perf.calibration import Calibration, medians, paired_difference
    calibration = Calibration(PerfModel(64, 256), size=256, tokens=128)
    times = {name: [0.01 * (i + 1)] * 9 for i, name in enumerate(calibration.probes())}
    # Rounds 5-8 ran 30% slow; the unshadowed step of round 4 met a spike.
    speed = [1.0] * 5 + [1.3] * 4
    times["shadow_off"] = [s * 1.0 for s in speed]
    times["shadow_off"][4] = 2.0
    times["shadow_on"] = [s * 1.4 for s in speed]
    paired = paired_difference(times["shadow_on"], times["shadow_off"])
    assert abs(paired - 0.4) < 1e-12, paired
    by_rounds = calibration.fit_times(times)
    assert by_rounds == calibration.fit(medians(times), shadow_added=paired)
    assert by_rounds.shadow_time_per_expert > calibration.fit(medians(times)).shadow_time_per_expert
