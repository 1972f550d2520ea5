"""FP8 experts (#49): the recipes' quantisation, the emulated FP8 grouped GEMM against a per-block,
per-expert oracle, and the layer with `fp8=` (errors against fp32, modes, autocast, state dicts,
expert parallelism). Every test name contains "fp8"."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

import fmoe
from fmoe import kernels
from fmoe.experts import GroupedExperts
from fmoe.kernels import fp8, fp8_quant
from tests.dist_utils import run_ranks

E4M3 = torch.float8_e4m3fn

# The oracle's table, written out again: (activation tile along the sum, weight block over [K, O],
# power-of-two scales); None is the whole dimension.
ORACLE = {"blockwise": (128, (128, 128), False), "rowwise": (None, (None, 1), False), "mxfp8": (32, (32, 1), True)}


def oracle_quantised(t, block, pow2):
    """t [R, C] through e4m3 block by block (a Python loop): each block's amax over its real elements."""
    rows, cols = t.shape
    br, bc = rows if block[0] is None else block[0], cols if block[1] is None else block[1]
    out = torch.empty(rows, cols)
    for i in range(0, rows, br):
        for j in range(0, cols, bc):
            blk = t[i:i + br, j:j + bc].float()
            ratio = (blk.abs().max() / 448.0).item()
            scale = 1.0 if ratio == 0 else (2.0 ** math.ceil(math.log2(ratio)) if pow2 else ratio)
            scale = torch.tensor(scale, dtype=torch.float32)
            out[i:i + br, j:j + bc] = (blk / scale).clamp(-448, 448).to(E4M3).float() * scale
    return out


def oracle_grouped_mm(x, w, b, counts, recipe, act=None):
    """Forward and gradients of y = q(act(x)) @ q(w[e]) + b[e] expert by expert, with the product's
    gradient dy = probe: (y, dx, dw, db), every operand quantised along its own sum."""
    tile, wblock, pow2 = ORACLE[recipe]
    a = x if act is None else act(x)
    y = torch.zeros(x.shape[0], w.shape[2])
    da = torch.zeros(a.shape)
    dw, db = torch.zeros(w.shape), torch.zeros(b.shape)
    probe = probe_for(x.shape[0], w.shape[2])
    start = 0
    for e, n in enumerate(counts):
        seg = slice(start, start + n)
        start += n
        if n == 0:
            continue
        y[seg] = oracle_quantised(a[seg], (1, tile), pow2) @ oracle_quantised(w[e], wblock, pow2) + b[e]
        da[seg] = oracle_quantised(probe[seg], (1, tile), pow2) @ oracle_quantised(w[e].t(), wblock, pow2)
        dw[e] = oracle_quantised(a[seg].t(), (1, tile), pow2) @ oracle_quantised(probe[seg], (tile, 1), pow2)
        db[e] = probe[seg].sum(0)
    if act is None:
        dx = da
    else:
        h = x.detach().requires_grad_(True)
        dx = torch.autograd.grad(act(h), h, da)[0]
    return y, dx, dw, db


def wide_range(shape, seed):
    """Normal numbers times 2^u, u uniform in [-10, 10]: blocks cut in the wrong direction get other
    scales and, even with power-of-two scales, other values below e4m3's normal range."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp2(torch.rand(shape, generator=g) * 20 - 10)


def probe_for(rows, cols):
    return wide_range((rows, cols), 7)


def e4m3_values(shape, seed=0):
    """Random finite e4m3 numbers (as fp32), magnitudes spread over its range."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 8, shape, generator=g).float())
    return t.clamp(-448, 448).to(E4M3).float()


@pytest.mark.parametrize("recipe", fp8.RECIPES)
@pytest.mark.parametrize("kind", ["activation", "activation_down_columns", "weight"])
def test_fp8_round_trip_keeps_e4m3_values_and_power_of_two_scales(recipe, kind):
    """Blocks of e4m3 values whose amax is 448, times a power of two per block, come back exactly:
    the same e4m3 data and the same scales, partial last blocks included."""
    shape = (3, 200, 70) if kind == "weight" else (150, 200)
    quantiser = {"activation": lambda t: fp8.quantise_activation(t, recipe),
                 "activation_down_columns": lambda t: fp8.quantise_activation(t, recipe, reduce_dim=0),
                 "weight": lambda t: fp8.quantise_weight(t, recipe)}[kind]
    block = quantiser(torch.ones(shape)).block
    data = e4m3_values(shape)
    data[..., ::block[0], ::block[1]] = 448.0           # every block's first element: its amax
    scale_shape = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    scale = torch.exp2(torch.randint(-20, 20, scale_shape, generator=torch.Generator().manual_seed(1)).float())
    values = fp8.dequantise(fp8.Quantised(data.to(E4M3), scale, block))
    q = quantiser(values)
    assert q.data.dtype == E4M3 and q.data.shape == shape
    assert torch.equal(q.data.float(), data)
    assert torch.equal(q.scale.float(), scale)
    assert torch.equal(fp8.dequantise(q), values)


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_scales_shapes_and_amax_to_448(recipe):
    x = torch.randn(5, 200) * torch.logspace(-3, 3, 200)
    w = torch.randn(3, 200, 70)
    qx, qw = fp8.quantise_activation(x, recipe), fp8.quantise_weight(w, recipe)
    qd = fp8.quantise_activation(x, recipe, reduce_dim=0)
    want = {"blockwise": ((5, 2), (3, 2, 1), (1, 200)), "rowwise": ((5, 1), (3, 1, 70), (1, 200)),
            "mxfp8": ((5, 7), (3, 7, 70), (1, 200))}[recipe]
    assert (tuple(qx.scale.shape), tuple(qw.scale.shape), tuple(qd.scale.shape)) == want
    if recipe == "mxfp8":
        assert qx.scale.dtype == (fp8.E8M0 or torch.float32)
        ratio = torch.frexp(qx.scale.float())[0]
        assert torch.all(ratio == 0.5), "mxfp8 scales are powers of two"
    else:
        assert qx.scale.dtype == torch.float32
    # Each block's largest magnitude lands on 448 (blockwise, rowwise) or in [224, 448] (mxfp8).
    amax = fp8_quant._padded_blocks(qx.data.float().abs(), qx.block).amax(dim=(-3, -1))
    if recipe == "mxfp8":
        assert torch.all((amax >= 224) & (amax <= 448))
    else:
        assert torch.all(amax == 448)
    # A partial last block's scale is its real elements' amax / 448.
    if recipe == "blockwise":
        torch.testing.assert_close(qx.scale[:, 1], x[:, 128:].abs().amax(1) / 448, rtol=0, atol=0)


def test_fp8_zero_block_and_check():
    q = fp8.quantise_activation(torch.zeros(2, 130), "blockwise")
    assert torch.equal(q.scale, torch.ones(2, 2)) and not q.data.float().any()
    with pytest.raises(ValueError, match=r"fp8 must be None or one of \('blockwise', 'rowwise', 'mxfp8'\), got 'e5m2'"):
        fp8.check_fp8("e5m2")


@pytest.mark.parametrize("recipe", fp8.RECIPES)
@pytest.mark.parametrize("act", [None, F.gelu])
def test_fp8_grouped_mm_equals_the_per_expert_oracle(recipe, act):
    """Forward, input gradient and weight gradient (and the bias's) as the oracle computes them:
    segments of 150, 0 and 70 rows (tiles across 128 rows and partial ones), widths not a multiple
    of any block, 3 rows of dropped slots at the end."""
    counts, I, O = [150, 0, 70], 160, 72
    x = wide_range((sum(counts) + 3, I), 0).requires_grad_(True)
    w = wide_range((3, I, O), 1).requires_grad_(True)
    b = torch.randn(3, O, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
    y = kernels.fp8_grouped_mm(x, w, torch.tensor(counts), recipe, b, activation=act)
    (y * probe_for(*y.shape)).sum().backward()
    ref_y, ref_dx, ref_dw, ref_db = oracle_grouped_mm(x.detach(), w.detach(), b.detach(), counts, recipe, act)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, ref_y, **tol)
    assert not y[sum(counts):].any() and not x.grad[sum(counts):].any()
    torch.testing.assert_close(x.grad, ref_dx, **tol)
    torch.testing.assert_close(w.grad, ref_dw, **tol)
    torch.testing.assert_close(b.grad, ref_db, **tol)


def test_fp8_grouped_mm_keeps_dtypes():
    """The output in x's dtype, the gradients in their tensors' (bf16 in, bf16 out)."""
    x = torch.randn(6, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2, 16, 8, dtype=torch.bfloat16, requires_grad=True)
    y = kernels.fp8_grouped_mm(x, w, torch.tensor([2, 4]), "rowwise")
    y.float().sum().backward()
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="recipe must be one of"):
        kernels.fp8_grouped_mm(x, w, torch.tensor([2, 4]), "fp8")


# The layer with fp8= against the same layer in fp32: relative errors (Frobenius norms) measured at
# d_model 128, d_hidden 64, 4 experts, 256 tokens, top-2 (docs/fp8.md has the table): outputs 0.047-0.055,
# gradients 0.037-0.067 for every recipe and both activations; the bounds leave room for other seeds.
# The router's bias gradient (E = 4 sums over all tokens, with cancellation) measured up to 0.11.
OUTPUT_BOUND, GRAD_BOUND, ROUTER_BIAS_BOUND = 0.08, 0.10, 0.25
ROUTER_BIAS = "gate.gate.proj.bias"
D, H, E, T = 128, 64, 4, 256


def layer_run(fp8_recipe, activation="gelu", seed=0, autocast=False, **kwargs):
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=H, top_k=2, activation=activation,
                                    fp8=fp8_recipe, **kwargs)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).requires_grad_(True)
    probe = torch.randn(T, D, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    (y.float() * probe).sum().backward()
    grads = {"input": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}
    return layer, y.detach(), grads


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_layer_errors_against_fp32_within_bounds(recipe, activation):
    layer, y, grads = layer_run(recipe, activation)
    _, ref_y, ref_grads = layer_run(None, activation)
    assert type(layer.experts_call).__name__ == "GatherFp8Call" and layer.experts.fp8 == recipe
    assert 0 < rel(y, ref_y) < OUTPUT_BOUND
    for name, grad in grads.items():
        if name == "experts.b2_eD":     # the sum of the output's gradient: no FP8 operand in it
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6)
        else:
            assert 0 < rel(grad, ref_grads[name]) < (ROUTER_BIAS_BOUND if name == ROUTER_BIAS else GRAD_BOUND), name
        assert grad.dtype == torch.float32, name


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_recompute_modes_give_the_same_answer(recipe):
    """What the experts keep changes, nothing else: outputs and gradients bit-identical."""
    _, y, grads = layer_run(recipe, "swiglu", recompute="activation")
    for mode in ("experts", "none"):
        _, y_mode, grads_mode = layer_run(recipe, "swiglu", recompute=mode)
        assert torch.equal(y_mode, y), mode
        for name, grad in grads.items():
            assert torch.equal(grads_mode[name], grad), (mode, name)


def test_fp8_recompute_activation_keeps_x_and_the_pre_activation():
    """recompute="activation": the experts' backward holds x and the pre-activation, no activation."""
    experts = GroupedExperts(2, 16, 8, "gelu", fp8="blockwise")
    x = torch.randn(10, 16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        experts(x, torch.tensor([4, 6]))
    params = {p.data_ptr() for p in experts.parameters()}
    kept = [tuple(t.shape) for t in saved if t.data_ptr() not in params]
    assert kept == [(10, 16), (10, 8)]


def test_fp8_refusals_name_the_argument():
    choices = r"fp8 must be None or one of \('blockwise', 'rowwise', 'mxfp8'\), got 'e4m3'"
    with pytest.raises(ValueError, match=choices):
        fmoe.FMoETransformerMLP(num_expert=2, d_model=8, d_hidden=8, fp8="e4m3")
    with pytest.raises(ValueError, match=choices):
        GroupedExperts(2, 8, 8, fp8="e4m3")
    with pytest.raises(ValueError, match="fp8='rowwise' needs the stacked experts"):
        fmoe.FMoE(num_expert=2, d_model=8, expert=lambda d: torch.nn.Linear(d, d), fp8="rowwise")
    with pytest.raises(ValueError, match="fp8='mxfp8' does not run with sync_free=True"):
        fmoe.FMoETransformerMLP(num_expert=2, d_model=8, d_hidden=8, fp8="mxfp8", sync_free=True,
                                exchange="rank", max_tokens_per_rank=4)


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_under_bf16_autocast(recipe):
    """bf16 autocast: the output in bf16, the master weights' gradients fp32, errors as bf16 + FP8
    against the fp32 layer (measured 0.05-0.07; bounds as above)."""
    layer, y, grads = layer_run(recipe, autocast=True)
    _, ref_y, ref_grads = layer_run(None)
    assert y.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in layer.parameters())
    assert rel(y, ref_y) < OUTPUT_BOUND
    for name, grad in grads.items():
        assert grad.dtype == torch.float32, name
        assert rel(grad, ref_grads[name]) < (ROUTER_BIAS_BOUND if name == ROUTER_BIAS else GRAD_BOUND), name


def test_fp8_state_dict_loads_into_a_layer_without_fp8():
    """No FP8 state is saved: an fp8=None layer loads the state dict strictly and computes in fp32
    what the fp8 layer's weights compute."""
    layer, _, _ = layer_run("blockwise")
    state = layer.state_dict()
    assert all(t.dtype == torch.float32 for t in state.values())
    plain = fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=H, top_k=2)
    plain.load_state_dict(state, strict=True)
    back = fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=H, top_k=2, fp8="blockwise")
    back.load_state_dict(plain.state_dict(), strict=True)
    x = torch.randn(16, D)
    with torch.no_grad():
        torch.testing.assert_close(back(x), layer(x), rtol=0, atol=0)
        assert rel(plain(x), layer(x)) < OUTPUT_BOUND


def ep_fp8_worker(rank, world, exchange="slot"):
    """fp8 at ep_size 2 over `exchange` ("node": two nodes of one rank, two hops), its rows and output
    gradients travelling as FP8, against fp8 on one process
    holding every expert: the output and x's gradient equal to rounding (the experts' GEMMs quantise
    the received rows in the tiles they travelled in: the same e4m3 values), the router's gradients
    too; the experts' weight gradients, whose tiles run along the tokens of values already rounded to
    e4m3, within FP8's error."""
    from tests.dist_workers import D as width, build_pair
    for recipe in fp8.RECIPES:
        node = {"ranks_per_node": 1} if exchange == "node" else {}
        full, ep = build_pair("naive", 2, 2, world, rank, fp8=recipe, activation="swiglu",
                              ep_kwargs={"exchange": exchange, **node})
        g = torch.Generator().manual_seed(5)
        tokens = 40
        x_all = torch.randn(tokens * world, width, generator=g, requires_grad=True)
        probe = torch.randn(tokens * world, width, generator=g)
        (full(x_all) * probe).sum().backward()
        lo, hi = tokens * rank, tokens * (rank + 1)
        x = x_all.detach()[lo:hi].clone().requires_grad_(True)
        out = ep(x)
        (out * probe[lo:hi]).sum().backward()
        with torch.no_grad():
            ref_out = full(x_all)[lo:hi]
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6, msg=lambda m: f"{recipe} out: {m}")
        for name, p in ep.experts.named_parameters():
            ref = getattr(full.experts, name).grad[rank * 2:(rank + 1) * 2]
            error = float((p.grad - ref).norm() / ref.norm())
            assert error < 0.1, (recipe, name, error)
        gate_grads = []
        for (name, p), (_, q) in zip(ep.gate.named_parameters(), full.gate.named_parameters()):
            grad = p.grad.clone()
            torch.distributed.all_reduce(grad)
            gate_grads.append((name, grad, q.grad))
        if exchange == "slot":
            torch.testing.assert_close(x.grad, x_all.grad[lo:hi], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{recipe} dx: {m}")
            for name, grad, ref in gate_grads:
                torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{recipe} gate {name}: {m}")
        else:
            # The deduplicated exchanges weigh a token's expert outputs where the experts are, so the routing
            # weights' gradients (and through the router, x's and the router's) read the output gradient
            # that travelled as FP8: within FP8's error of one process, not to rounding.
            error = float((x.grad - x_all.grad[lo:hi]).norm() / x_all.grad[lo:hi].norm())
            assert error < 0.1, (recipe, exchange, "dx", error)
            for name, grad, ref in gate_grads:
                assert float((grad - ref).norm() / ref.norm()) < 0.1, (recipe, exchange, name)


@pytest.mark.parametrize("exchange", ["slot", "rank", "node"])
def test_fp8_expert_parallel_equals_one_process(exchange):
    run_ranks(ep_fp8_worker, 2, exchange)


def fp8_bytes_worker(rank, world, out_file, exchange="slot"):
    """Bytes this rank's all-to-alls send to the other ranks in one bf16 step (forward and backward),
    counted at torch.distributed, with fp8=None and with each recipe."""
    import json
    import torch.distributed as dist
    sent = [0]
    plain = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        rows = input_split_sizes or [input.shape[0] // world] * world
        row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
        sent[0] += sum(n for w, n in enumerate(rows) if w != dist.get_rank(group)) * row_bytes
        return plain(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = counting
    result = {}
    try:
        for recipe in (None,) + fp8.RECIPES:
            torch.manual_seed(0)
            layer = fmoe.FMoETransformerMLP(num_expert=2, world_size=world, d_model=256, d_hidden=64, top_k=2,
                                            fp8=recipe, exchange=exchange).to(torch.bfloat16)
            x = torch.randn(64, 256, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
            x.requires_grad_(True)
            sent[0] = 0
            layer(x).float().sum().backward()
            result[str(recipe)] = sent[0]
    finally:
        dist.all_to_all_single = plain
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(result, f)


def test_fp8_expert_parallel_bytes_are_at_most_0_8_of_bf16(tmp_path):
    """#49: the rows out and their output gradients travel as e4m3 and scales, the legs back in bf16."""
    import json
    out = tmp_path / "bytes.json"
    run_ranks(fp8_bytes_worker, 2, str(out))
    sent = json.loads(out.read_text())
    for recipe in fp8.RECIPES:
        assert sent[recipe] <= 0.8 * sent["None"], (recipe, sent)
    run_ranks(fp8_bytes_worker, 2, str(out), "rank")       # the deduplicated exchange: bf16 on every leg without fp8
    dedup = json.loads(out.read_text())
    for recipe in fp8.RECIPES:      # rows and output gradients 1 byte (+ scales), the legs back 2: (1 + 2) / 4
        assert dedup[recipe] <= 0.8 * dedup["None"], (recipe, dedup)
    # bf16 rows out and back, gradients back and out: 4 legs of 2 bytes an element, of which the bf16 lean
    # path sends the combine and its gradient in fp32 (its weighted rows are summed once, in fp32); fp8
    # sends 1 byte and a scale out, 2 bytes back: at most (1 + 4/128 + 2) * 2 / (2 * 2 + 4 * 2) of it
    assert sent["blockwise"] <= (1 + 4 / 128 + 2) * 2 / 12 * sent["None"] * 1.05, sent


def test_fp8_fmoe_train_runs_each_recipe_and_resumes_without_it(tmp_path):
    """`fmoe train --fp8 RECIPE`: the layers' experts run that recipe, the loss is finite and near the
    unquantised run's; the checkpoint holds no FP8 state, so the run resumes without --fp8."""
    import json

    from fmoe.app.cli import main
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(200)))
    tiny = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--num-expert", "4",
            "--d-hidden", "64", "--batch-size", "4", "--data", str(corpus), "--no-progress", "--log", "none"]
    losses = {}
    for recipe in (None, "blockwise", "rowwise", "mxfp8"):
        out = tmp_path / str(recipe)
        assert main(["train", *tiny, "--steps", "3", "--out", str(out)] + (["--fp8", recipe] if recipe else [])) == 0
        losses[recipe] = json.loads((out / "history.json").read_text())["loss"]
    for recipe in ("blockwise", "rowwise", "mxfp8"):
        assert all(abs(a - b) < 0.05 * b for a, b in zip(losses[recipe], losses[None])), (recipe, losses)
    assert main(["train", *tiny, "--steps", "4", "--out", str(tmp_path / "rowwise"), "--resume"]) == 0
    assert json.loads((tmp_path / "rowwise" / "history.json").read_text())["step"][-1] == 4


def test_fp8_fmoe_train_builds_the_layers_with_the_recipe_and_refuses_a_bad_one():
    from fmoe.app.gpt import GPT, GPTConfig
    from fmoe.app.runtime import TrainConfig
    model = GPT(GPTConfig(d_model=32, n_layer=2, n_head=2, seq_len=16, num_expert=4, d_hidden=64), fp8="mxfp8")
    assert [layer.experts.fp8 for layer in model.moe_layers()] == ["mxfp8", "mxfp8"]
    with pytest.raises(ValueError, match="--fp8 must be one of blockwise, rowwise, mxfp8"):
        TrainConfig(fp8="e5m2")


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_triton_kernel_equals_the_emulation(recipe):
    """Triton's FP8 grouped GEMM (the interpreter here) against the torch emulation, forward (x @ w) and input
    gradient (dy @ w^T through w's strides): partial blocks along K, an empty expert, rows past the segments."""
    from fmoe.kernels.triton_fp8 import fp8_grouped_mm_rows
    torch.manual_seed(0)
    N, K, O = 37, 200, 72
    counts = torch.tensor([10, 0, 20, 5])
    a, w, dy = torch.randn(N, K), torch.randn(4, K, O) * 0.1, torch.randn(N, O)
    qa, qw = fp8.quantise_activation(a, recipe), fp8.quantise_weight(w, recipe)
    y = fp8_grouped_mm_rows(qa.data, qa.scale, qa.block[1], qw.data, qw.scale, qw.block, counts)
    want = fp8.forward_product(a, w, counts.tolist(), recipe)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert y[35:].abs().max() == 0
    dx = fp8.input_gradient(dy, w, counts.tolist(), recipe, counts_e=counts)
    torch.testing.assert_close(dx, fp8.input_gradient(dy, w, counts.tolist(), recipe), rtol=1e-5, atol=1e-5)


def test_fp8_mxfp8_on_the_block_scaled_mma_equals_the_emulation():
    """MXFP8 on Blackwell's block-scaled MMA (`tl.dot_scaled`, e8m0 scale bytes; the interpreter here): forward
    and input gradient (w^T's own quantisation, through its strides) as the emulation computes them, with K
    (200) ending inside a 128-wide step and inside a 32-wide block."""
    from fmoe.kernels.triton_fp8 import e8m0_bytes, fp8_grouped_mm_rows
    torch.manual_seed(0)
    counts = torch.tensor([10, 0, 20, 5])
    a, w, dy = torch.randn(37, 200), torch.randn(4, 200, 72) * 0.1, torch.randn(37, 72)
    for x, weight, want in ((a, w, fp8.forward_product(a, w, counts.tolist(), "mxfp8")),
                            (dy, w.transpose(1, 2), fp8.input_gradient(dy, w, counts.tolist(), "mxfp8"))):
        qx, qw = fp8.quantise_activation(x, "mxfp8"), fp8.quantise_weight(weight, "mxfp8")
        y = fp8_grouped_mm_rows(qx.data, qx.scale, qx.block[1], qw.data, qw.scale, qw.block, counts,
                                block_scaled=True)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert e8m0_bytes(torch.tensor([1.0, 0.5, 2.0 ** 127, 2.0 ** -127])).tolist() == [127, 126, 254, 0]
    with pytest.raises(ValueError, match="block_scaled takes MXFP8's blocks"):
        qa, qw = fp8.quantise_activation(a, "blockwise"), fp8.quantise_weight(w, "blockwise")
        fp8_grouped_mm_rows(qa.data, qa.scale, qa.block[1], qw.data, qw.scale, qw.block, counts, block_scaled=True)


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_triton_weight_gradient_equals_the_emulation(recipe):
    """Triton's FP8 weight gradient against the emulation: segments across the 128-row tile, an empty expert,
    rows past the segments (tiles run from each segment's start)."""
    torch.manual_seed(0)
    counts = [150, 0, 100, 40]
    a, dy = torch.randn(300, 40), torch.randn(300, 24)
    want = fp8.weight_gradient(a, dy, counts, recipe)
    got = fp8.weight_gradient(a, dy, counts, recipe, counts_e=torch.tensor(counts))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert got[1].abs().max() == 0


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_experts_on_triton_equal_the_emulation(recipe):
    """GroupedExperts(fp8=..., backend="triton"): output and every gradient equal the torch backend's."""
    torch.manual_seed(0)
    ref = GroupedExperts(3, 40, 24, "swiglu", fp8=recipe, backend="torch")
    got = GroupedExperts(3, 40, 24, "swiglu", fp8=recipe, backend="triton")
    got.load_state_dict(ref.state_dict())
    counts = torch.tensor([4, 0, 5])
    x = torch.randn(11, 40)
    outs = []
    for layer in (ref, got):
        x_ = x.clone().requires_grad_()
        y = layer(x_, counts)
        y.backward(torch.ones_like(y))
        outs.append((y, x_.grad, layer.w1_eDF.grad, layer.w2_eFD.grad))
    for want, have in zip(*outs):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)


def test_fp8_refuses_a_gpu_without_fp8_tensor_cores():
    from fmoe.kernels import check_fp8_tensor_cores
    with pytest.raises(ValueError, match=r"sm_80\) has no FP8 tensor cores.*FMOE_BACKEND=torch"):
        check_fp8_tensor_cores((8, 0), "blockwise")
    check_fp8_tensor_cores((8, 9), "blockwise")
    check_fp8_tensor_cores((9, 0), "rowwise")


def test_fp8_compiled_equals_eager(recipe="blockwise"):
    """torch.compile (aot_eager) of an fp8 layer: the output and x's gradient of eager. The FP8 GEMMs read the
    counts on the host, so they run eagerly at a graph break (the same for every recipe); fullgraph=True
    refuses them."""
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=4, d_model=32, d_hidden=64, top_k=2, fp8=recipe)
    x = torch.randn(16, 32, requires_grad=True)
    layer(x).sum().backward()
    want = x.grad.clone()
    x.grad = None
    torch._dynamo.reset()
    y = torch.compile(layer, backend="aot_eager")(x)
    y.sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(y, layer(x), rtol=0, atol=0)
    torch.testing.assert_close(x.grad, want, rtol=0, atol=0)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="disable"):
        torch.compile(layer, backend="aot_eager", fullgraph=True)(x)


@pytest.mark.parametrize("seam", [False, True])
def test_fp8_on_a_converted_transformers_model(seam):
    """fmoe.hf.convert(model, fp8=...) whole and at the experts seam: the experts run the recipe, the logits
    stay within FP8's error of the unconverted model's."""
    pytest.importorskip("transformers")
    import fmoe.integrations.hf as fhf
    from tests.hf_models import tiny, tokens
    model = tiny("qwen3_moe")
    ids = tokens()
    with torch.no_grad():
        want = model(ids).logits
    fhf.convert(model, fp8="rowwise", seam=seam)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert experts and all(m.fp8 == "rowwise" for m in experts)
    with torch.no_grad():
        got = model(ids).logits
    assert 0 < rel(got, want) < OUTPUT_BOUND


def fp8_shadow_worker(rank, world):
    """fp8 with FasterMoE's shadowing of a hot expert against the same fp8 layer without it, at 2 ranks: the
    shadowed rows stay home in full precision and the experts quantise them in the tiles they would have
    travelled in, so output and x's gradient agree to rounding; the shadowed expert's weight gradient
    (tiles along each rank's own rows, then summed) within FP8's error."""
    from tests.shadow_workers import FixedShadow, build
    hot = [0]
    runs = []
    for shadow in (False, FixedShadow(hot)):
        layer = build(world, 2, 2, hot, activation="swiglu", fp8="blockwise", shadow=shadow)
        torch.manual_seed(10 + rank)
        with torch.no_grad():
            for p in layer.experts.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(14, layer.d_model, generator=g).requires_grad_(True)
        shadow_rows = []
        plan_of = layer.dispatcher.plan
        layer.dispatcher.plan = lambda routing: shadow_rows.append(plan_of(routing)) or shadow_rows[-1]
        out = layer(x)
        (out * torch.randn(out.shape, generator=g)).sum().backward()
        assert (shadow_rows[0].num_shadow_rows > 0) == bool(shadow), "the hot expert's rows stayed home"
        runs.append((out.detach(), x.grad, {n: p.grad for n, p in layer.experts.named_parameters()}))
    (out0, dx0, g0), (out1, dx1, g1) = runs
    torch.testing.assert_close(out1, out0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx1, dx0, rtol=1e-5, atol=1e-5)
    for name in g0:
        assert float((g1[name] - g0[name]).norm() / g0[name].norm()) < 0.1, name


def test_fp8_with_shadowing_equals_without():
    run_ranks(fp8_shadow_worker, 2)


def fp8_overlap_worker(rank, world, exchange="slot"):
    """fp8 rows under every overlap mode (in line, beside the shared experts, pipelined in chunks of experts):
    the same output and gradients, bit for bit (the rows' tiles run along each row, so chunks quantise
    alike). The rank exchange's chunks (FMOE_PIPELINE_CHUNKS=2) split an expert's rows over GEMMs, each
    quantising its own weight-gradient tiles: the outputs to rounding, the weight gradients within FP8's error."""
    import os
    from tests.dist_workers import build_pair
    results = {}
    runs = [("none", 0), ("shared", 0), ("pipeline", 0)] + ([("pipeline", 2)] if exchange == "rank" else [])
    for overlap, chunks in runs:
        if chunks:
            os.environ["FMOE_PIPELINE_CHUNKS"] = str(chunks)
        _, ep = build_pair("naive", 2, 2, world, rank, fp8="blockwise", activation="swiglu", shared_expert=16,
                           ep_kwargs={"overlap": overlap, "exchange": exchange})
        x = torch.randn(24, ep.d_model, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
        out = ep(x)
        out.sum().backward()
        results[overlap, chunks] = (out.detach(), x.grad, {n: p.grad for n, p in ep.named_parameters()})
    os.environ.pop("FMOE_PIPELINE_CHUNKS", None)
    base = results["none", 0]
    for run in runs[1:3]:
        out, dx, grads = results[run]
        assert torch.equal(out, base[0]) and torch.equal(dx, base[1]), run
        assert all(torch.equal(grads[n], base[2][n]) for n in grads), run
    if exchange == "rank":
        out, dx, grads = results["pipeline", 2]
        torch.testing.assert_close(out, base[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx, base[1], rtol=1e-2, atol=1e-3)
        for name in grads:
            assert float((grads[name] - base[2][name]).norm() / base[2][name].norm()) < 0.1, name


@pytest.mark.parametrize("exchange", ["slot", "rank"])
def test_fp8_rows_under_every_overlap_mode_are_bit_identical(exchange):
    run_ranks(fp8_overlap_worker, 2, exchange)


def test_fp8_router_replay_capacity_and_gradient_accumulation():
    """With fp8: router replay makes a layer with another router choose the recorded experts; a capacity drops (and reports) the same slots as without fp8; two accumulated
    half-batches give the whole batch's gradients to fp32 rounding (each GEMM quantises per row and per
    expert segment of its own batch, so the tiles of the weight gradient differ: within FP8's error)."""
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=4, d_model=32, d_hidden=64, top_k=2, fp8="rowwise")
    other = copy.deepcopy(layer)
    with torch.no_grad():
        for p in other.gate.parameters():
            p.add_(torch.randn_like(p))
    x = torch.randn(24, 32)
    chosen = []
    for module in (layer, other):
        module.gate_hook = lambda idx, weight, _: chosen.append(idx.sort(dim=1).values)
    with fmoe.record_routing(layer) as trace, torch.no_grad():
        layer(x)
    with torch.no_grad():
        other(x)
    with fmoe.replay_routing(other, trace), torch.no_grad():
        other(x)
    for module in (layer, other):
        module.gate_hook = None
    assert not torch.equal(chosen[1], chosen[0]) and torch.equal(chosen[2], chosen[0])

    capped = {}
    for recipe in (None, "blockwise"):
        torch.manual_seed(1)
        capped[recipe] = fmoe.FMoETransformerMLP(num_expert=4, d_model=32, d_hidden=64, top_k=2, gate="gshard",
                                                 gate_kwargs={"capacity": (0.5, 0.5), "random_routing": False},
                                                 fp8=recipe)
        capped[recipe](x)
    assert capped["blockwise"].num_dropped == capped[None].num_dropped > 0

    whole = copy.deepcopy(layer)
    whole(x).sum().backward()
    layer(x[:12]).sum().backward()
    layer(x[12:]).sum().backward()
    for (name, p), (_, q) in zip(layer.named_parameters(), whole.named_parameters()):
        assert rel(p.grad, q.grad) < GRAD_BOUND, name
