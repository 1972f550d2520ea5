"""`fmoe bench`: the FLOP counter, the peak table, saved-bytes counting, competitors computing fmoe's
function on fmoe's routing, and `fmoe bench --quick` as a user runs it."""
import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from fmoe.bench import competitors as comp
from fmoe.bench.flops import dense_ffn_flops, device_peak, layer_flops, measure_matmul_peak
from fmoe.bench.measure import saved_bytes
from fmoe.bench.run import main as bench_main, sweep_point
from fmoe.bench.workload import Point, imbalance, make_workload, skewed_routing


def test_layer_flops_fastmoe_convention():
    f = layer_flops(tokens=2048, d_model=512, d_hidden=2048, top_k=2, num_expert=8)
    experts = 2 * 2048 * 2 * 512 * 2048 * 2         # two GEMMs over 4096 routed rows
    gate = 2 * 2048 * 512 * 8
    assert f == {"forward": experts + gate, "backward": 2 * (experts + gate), "total": 3 * (experts + gate)}
    assert f["forward"] == 17_196_646_400
    assert dense_ffn_flops(4096, 512, 2048)["forward"] == experts
    with pytest.raises(ValueError, match="top_k"):
        layer_flops(2048, 512, 2048, 0, 8)


@pytest.mark.parametrize("name,dtype,tflops", [
    ("Tesla V100-SXM2-32GB", torch.float32, 15.7), ("Tesla V100-PCIE-16GB", torch.float16, 112.0),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0), ("NVIDIA A100-PCIE-40GB", torch.float32, 19.5),
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4), ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
    ("NVIDIA H200", torch.float32, 67.0), ("NVIDIA H200", torch.bfloat16, 989.4),
])
def test_peak_table(name, dtype, tflops):
    assert device_peak(name, dtype) == pytest.approx(tflops * 1e12)


def test_peak_table_unknowns():
    assert device_peak("NVIDIA GeForce GTX 1080", torch.float32) is None
    assert device_peak("Tesla V100-SXM2-32GB", torch.bfloat16) is None     # no bf16 tensor cores
    with pytest.raises(ValueError, match="dtype"):
        device_peak("NVIDIA H200", torch.int8)
    assert measure_matmul_peak(torch.device("cpu"), torch.float32, size=64, reps=2) > 0


def test_saved_bytes_counts_each_storage_once_and_skips_parameters():
    x = torch.randn(32, 16, requires_grad=True)
    assert saved_bytes(lambda t: t * t, x, [])[0] == x.nbytes          # x saved twice, one storage
    assert saved_bytes(lambda t: t[:, :8].sin(), x, [])[0] == x.nbytes      # a view: its whole storage
    linear = nn.Linear(16, 64)
    nbytes, y = saved_bytes(lambda t: torch.relu(linear(t)), x, list(linear.parameters()))
    assert nbytes == x.nbytes + y.nbytes           # linear's input and relu's output, not the weight


def test_skewed_routing():
    idx = skewed_routing(64, 4, 2, 0.0)
    assert torch.equal(torch.bincount(idx.reshape(-1)), torch.full((4,), 32))
    idx = skewed_routing(512, 8, 3, 2.0, seed=1)
    assert all(len(set(row)) == 3 for row in idx.tolist())
    assert imbalance(Point(512, 8, 16, 8, 3, skew=2.0)) > 2 * imbalance(Point(512, 8, 16, 8, 3, skew=0.0))
    with pytest.raises(ValueError, match="top_k"):
        Point(64, 8, 16, num_expert=2, top_k=3)
    assert sweep_point(Point(64, 8, 16, 8, 2), "num_expert", 1).top_k == 1
    assert sweep_point(Point(64, 8, 16, 4, 2), "top_k", 8) is None


def _run(c):
    c.x.grad = None
    for p in c.params:
        p.grad = None
    y = c.fn(c.x)
    y.backward(c.grad)
    grads = {"x": c.x.grad.clone()}
    return y.detach(), grads


@pytest.mark.parametrize("top_k,skew", [(1, 0.0), (2, 0.0), (2, 1.5), (3, 1.0)])
@pytest.mark.parametrize("name", ["per_token", "masked_loop", "grouped_mm"])
def test_competitors_compute_fmoe_function(name, top_k, skew):
    """Same routing, same weights: the same outputs and input gradients as fmoe (and the same
    expert weight gradients where they see the whole batch)."""
    w = make_workload(Point(tokens=48, d_model=16, d_hidden=32, num_expert=4, top_k=top_k, skew=skew),
                      torch.device("cpu"), torch.float32)
    ref = comp.build_fmoe(w)
    y_ref, g_ref = _run(ref)
    w1_grad = w.layer.experts.w1_eDF.grad.clone()
    c = comp.COMPETITORS[name](w)
    y, g = _run(c)
    rows = c.same_rows
    torch.testing.assert_close(y, y_ref[:rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g["x"], g_ref["x"][:rows], atol=1e-5, rtol=1e-5)
    if rows == w.point.tokens:
        torch.testing.assert_close(w.layer.experts.w1_eDF.grad, w1_grad, atol=1e-5, rtol=1e-5)


def test_missing_deepspeed_is_skipped_with_a_reason(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    monkeypatch.setitem(sys.modules, "deepspeed.moe.sharded_moe", None)
    w = make_workload(Point(16, 8, 16, 2, 1), torch.device("cpu"), torch.float32)
    with pytest.raises(comp.Unavailable, match="import deepspeed failed"):
        comp.build_deepspeed(w)
    assert bench_main(["--quick", "--sweep", "none", "--competitors", "deepspeed", "--no-progress", "--no-plots",
                       "--out", str(tmp_path)]) == 0
    assert "skipped deepspeed: import deepspeed failed" in capsys.readouterr().out
    report = json.loads((tmp_path / "gflops-cpu.json").read_text())
    assert list(report["points"][0]["results"]) == ["fmoe"]
    assert "import deepspeed failed" in report["skipped"]["deepspeed"]


def test_bench_quick_cli(tmp_path):
    """`fmoe bench --quick` in its own process (DeepSpeed opens a process group): valid JSON, plots,
    and every competitor that computes fmoe's function agreeing with it."""
    done = subprocess.run([sys.executable, "-m", "fmoe", "bench", "--quick", "--no-progress", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gflops-cpu.json").read_text())
    assert (tmp_path / "gflops-cpu-num_expert.png").stat().st_size > 0
    assert (tmp_path / "gflops-cpu-tokens.png").stat().st_size > 0
    expected = set(comp.COMPETITORS) - set(report["skipped"])
    if importlib.util.find_spec("deepspeed") is not None:
        assert {"deepspeed", "deepspeed_default"} <= expected, report["skipped"]
    for entry in report["points"]:
        assert set(entry["results"]) == expected
        for name, r in entry["results"].items():
            assert r["gflops"]["total"] > 0 and r["saved_bytes"] > 0
            assert r["agrees"] in (True, None), f"{name} differs from fmoe at {entry['point']}: {r['max_abs_diff']}"
            if name not in ("fmoe", "dense_ffn") and r["dropped"] == 0:
                assert r["agrees"] is True, name
