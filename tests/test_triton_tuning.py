"""A new shape's configs are compiled together, before the autotuner times them, and they are the
very kernels it then launches (`fmoe.kernels.triton_tuning`).

`tests/tuning_probe.py` drives the real JIT and autotuner of this Triton with a stand-in sm_90
driver (compiles for real, launches nothing), in a subprocess without TRITON_INTERPRET, and lists
every compile and launch in order.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fmoe.kernels import triton_tuning

ROOT = Path(__file__).resolve().parent.parent
POOL = "fmoe-compile"

needs_async_compile = pytest.mark.skipif(triton_tuning.AsyncCompileMode is None,
                                         reason="this Triton has no AsyncCompileMode (before 3.4): configs "
                                                "compile one by one, as Triton's autotuner does")


def _probe(tmp_path, threads):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-m", "tests.tuning_probe", "--cache-dir", str(tmp_path / "triton"),
                          "--threads", str(threads)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def together(tmp_path_factory):
    return _probe(tmp_path_factory.mktemp("together"), threads=3)


def _split(events):
    compiles = [e for e in events if e["kind"] == "compile"]
    launches = [e for e in events if e["kind"] == "launch"]
    return compiles, launches


@needs_async_compile
def test_a_new_shape_compiles_every_config_on_the_pool_before_the_first_timed_launch(together):
    assert together["tuner"] == "CompileTogether"
    events = together["phases"]["new shape"]["events"]
    compiles, launches = _split(events)
    assert len(compiles) == together["configs"] == 3
    assert all(e["thread"].startswith(POOL) for e in compiles)
    first_launch = events.index(launches[0])
    assert all(events.index(e) < first_launch for e in compiles), "a config compiled after the timing began"
    # They ran at once: every compile started before any of them ended.
    assert max(e["start"] for e in compiles) < min(e["at"] for e in compiles)


@needs_async_compile
def test_the_autotuner_launches_exactly_the_kernels_compiled_together(together):
    compiles, launches = _split(together["phases"]["new shape"]["events"])
    compiled = {e["kernel"] for e in compiles}
    assert len(compiled) == 3
    # One timed launch per config, then the winner's launch: nothing recompiled, nothing else run.
    assert len(launches) == 4
    assert {e["kernel"] for e in launches[:3]} == compiled
    assert launches[-1]["kernel"] == launches[0]["kernel"]      # the stand-in timing makes the first win


@needs_async_compile
def test_a_shape_tuned_by_an_earlier_process_compiles_its_winner_only(together):
    winner = _split(together["phases"]["new shape"]["events"])[1][-1]["kernel"]
    compiles, launches = _split(together["phases"]["tuned before"]["events"])
    assert [e["kernel"] for e in compiles] == [winner]
    assert compiles[0]["thread"] == "MainThread"
    assert [e["kernel"] for e in launches] == [winner]
    assert together["phases"]["tuned before"]["best"] == together["phases"]["new shape"]["best"]


def test_one_compile_thread_compiles_each_config_when_it_is_timed(tmp_path):
    events = _probe(tmp_path, threads=1)["phases"]["new shape"]["events"]
    assert [e["kind"] for e in events] == ["compile", "launch"] * 3 + ["launch"]
    assert all(e["thread"] == "MainThread" for e in events)


def test_compile_threads_reads_its_variable(monkeypatch):
    monkeypatch.setenv("FMOE_COMPILE_THREADS", "5")
    assert triton_tuning.compile_threads() == 5
    monkeypatch.delenv("FMOE_COMPILE_THREADS")
    assert triton_tuning.compile_threads() == len(os.sched_getaffinity(0))
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("FMOE_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match="FMOE_COMPILE_THREADS must be a whole number >= 1"):
            triton_tuning.compile_threads()


def test_the_first_compile_benchmark_times_both_ways(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = tmp_path / "first-compile.json"
    run = subprocess.run([sys.executable, "benchmarks/bench_first_compile.py", "--quick", "--threads", "2",
                          "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["target"] == "sm_90" and result["threads"] == 2
    assert [(s["step"], s["configs"]) for s in result["steps"]] == [("up_act[swiglu]", 3)]
    assert all(s["one_by_one_s"] > 0 and s["together_s"] > 0 for s in result["steps"])
    assert "together / one by one" in run.stdout
