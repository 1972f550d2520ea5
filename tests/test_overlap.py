"""Communication hidden behind compute (#48): the simulated link, and the overlap modes equal to "none"."""
import json

import pytest

from fmoe.distributed import link
from tests import overlap_workers
from tests.dist_utils import run_ranks


def test_overlap_link_spec_parses_and_bad_specs_name_the_variable(monkeypatch):
    assert link.parse_link("gbps=10,latency_us=50") == link.Link(10.0, 50.0)
    assert link.parse_link(" gbps = 2.5 ") == link.Link(2.5, 0.0)
    for bad, named in [("latency_us=5", "gbps=G"), ("gbps=fast", "gbps must be a number"),
                       ("gbps=1,speed=2", "unknown part"), ("gbps=0", "positive"), ("gbps=1,latency_us=-1", ">= 0")]:
        with pytest.raises(ValueError, match=named):
            link.parse_link(bad)
    monkeypatch.setenv(link.ENV, "gbps=8,latency_us=100")
    assert link.active_link() == link.Link(8.0, 100.0)
    with link.simulated_link(None):
        assert link.active_link() is None, "simulated_link(None) turns the variable's link off inside"
    with link.simulated_link(1.0):
        assert link.active_link() == link.Link(1.0, 0.0)
    monkeypatch.delenv(link.ENV)
    assert link.active_link() is None


def test_overlap_link_seconds_are_latency_plus_bytes_over_bandwidth():
    assert link.Link(8.0, 250.0).seconds(10**9) == pytest.approx(250e-6 + 1.0)
    assert link.all_to_all_bytes([5, 3, 7], [1, 9, 2], 16, rank=1) == max(5 + 7, 1 + 2) * 16
    assert link.all_reduce_bytes(1000, 4) == 1500


def test_overlap_simulated_link_makes_a_collective_of_b_bytes_take_at_least_b_over_g(tmp_path):
    out = tmp_path / "took.json"
    run_ranks(overlap_workers.time_an_all_to_all, 2, 2048, 64, 0.02, 20_000.0, str(out))
    took = json.loads(out.read_text())
    floor = link.Link(0.02, 20_000.0).seconds(took["bytes"])      # 512 KiB at 20 Mbit/s + 20 ms: 0.23 s
    assert took["bytes"] == 2048 * 64 * 4
    assert took["seconds"] >= floor, took


def test_overlap_simulated_link_delay_is_paid_at_the_wait_so_work_between_hides_it(tmp_path):
    """1 s of link and 0.8 s of work between start and wait: about 1 s in all, not 1.8 s."""
    out = tmp_path / "took.json"
    rows, width = 4096, 61          # 999,424 bytes each way: 1.0 s at 8 Mbit/s
    run_ranks(overlap_workers.wait_pays_the_delay, 2, 0.8, 0.008, rows, width, str(out))
    took = json.loads(out.read_text())["seconds"]
    assert 0.99 <= took < 1.5, took


@pytest.mark.parametrize("world", [2, 4])
def test_overlap_modes_give_the_bit_identical_outputs_gradients_and_counts_of_none(world):
    run_ranks(overlap_workers.check_overlap_modes_equal_none, world)


def test_overlap_weight_gradients_compute_while_the_input_gradient_travels():
    run_ranks(overlap_workers.check_overlap_weight_grads_run_while_the_input_gradient_travels, 2)


def test_overlap_compiled_equals_eager_none():
    run_ranks(overlap_workers.check_overlap_compiled_equals_eager_none, 2)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_overlap_a_rank_stopped_while_handles_are_in_flight_fails_the_other_naming_the_layer(phase, tmp_path):
    from tests.test_fault_dist import what_rank_0_saw_of_a_stopped_peer
    message = what_rank_0_saw_of_a_stopped_peer(overlap_workers.stop_rank_while_in_flight, phase, tmp_path)
    assert "FMOE_COLLECTIVE_TIMEOUT" in message and "all-to-all" in message, message
    assert "expert-parallel layer #0 FMoETransformerMLP(num_expert=2, d_model=8)" in message, message


def test_overlap_simulated_link_queues_collectives_in_flight_together(tmp_path):
    out = tmp_path / "took.json"
    run_ranks(overlap_workers.two_in_flight_queue, 2, 0.02, 1024, 16, str(out))
    took = json.loads(out.read_text())
    assert took["seconds"] >= 2 * took["one"], took


@pytest.mark.parametrize("world", [2, 4])
def test_overlap_pipeline_chunks_the_rank_and_node_exchanges_in_as_many_chunks_on_every_rank(world):
    run_ranks(overlap_workers.check_pipeline_chunks_the_rank_and_node_exchanges, world)


@pytest.mark.parametrize("world", [2, 4])
def test_overlap_interleaved_micro_batches_equal_running_them_one_after_the_other(world):
    run_ranks(overlap_workers.check_interleaved_micro_batches_equal_one_after_the_other, world)


@pytest.mark.parametrize("world", [2, 4])
def test_overlap_interleaved_turns_pass_at_the_same_collectives_on_every_rank(world):
    run_ranks(overlap_workers.check_interleaved_turns_pass_at_the_same_collectives_on_every_rank, world)


def test_overlap_interleaved_one_forward_beside_the_others_backward_equal_running_them_one_after_the_other():
    """schedule="1f1b": the next micro-batch starts once the one before waits in its backward; the cases
    whose backward differs most between ranks (shadowing: the owner's graph is not the others')."""
    run_ranks(overlap_workers.check_interleaved_micro_batches_equal_one_after_the_other, 2,
              ["slot", "rank-shadow", "slot-shadow", "rank-sync-free", "slot-data-parallel"], "1f1b")


def test_overlap_example_trains_interleaved_micro_batches_equal_to_the_loop():
    """examples/overlap_micro_batches.py as the docs run it, at small shapes: both loops, the same weights."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "examples/overlap_micro_batches.py", "--schedule", "1f1b", "--steps", "2",
                          "--tokens", "64", "--seq", "16", "--layers", "1", "--gbps", "1"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "bit for bit: True" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


def test_overlap_interleaved_random_draws_are_per_micro_batch_and_reproducible():
    run_ranks(overlap_workers.check_interleaved_random_draws_are_the_first_micro_batchs_and_reproducible, 2)


def test_overlap_model_timelines_add_up():
    """The timeline of `fmoe.perf.overlap_model`: in line, the step is compute + link; overlapped, never
    less than the longer of the two; with no link every mode is the compute."""
    from fmoe.perf.overlap_model import Components, predict
    parts = Components(other=0.03, shared=0.06, experts=0.09)
    assert predict(parts, 0.12, "none") == pytest.approx(0.30)
    for mode, chunks, micro in [("shared", 1, 1), ("pipeline", 4, 1), ("pipeline", 4, 2), ("shared", 1, 2)]:
        assert predict(parts, 0.0, mode, chunks, micro) == pytest.approx(0.18)
        step = predict(parts, 0.12, mode, chunks, micro)
        assert 0.18 <= step < 0.30, (mode, chunks, micro, step)
    # shared hides the combine (the outputs' way back) behind the shared experts' forward and the output
    # gradients behind their backward: 0.02 and 0.04 of compute against legs of 0.03 each; and, the weight
    # gradients deferred, the input gradients behind them (0.03: half the experts' 0.06 of backward, against a leg of 0.03)
    assert predict(parts, 0.12, "shared", defer_weight_grads=False) == pytest.approx(0.30 - 0.02 - 0.03)
    assert predict(parts, 0.12, "shared") == pytest.approx(0.30 - 0.02 - 0.03 - 0.03)
    assert predict(parts, 0.12, "pipeline", 4) < predict(parts, 0.12, "shared")
    with pytest.raises(ValueError, match="mode must be one of"):
        predict(parts, 0.1, "chunks")
    # two micro-batches one after the other: twice a half step; interleaved, less, whichever schedule
    loop = predict(parts, 0.12, "pipeline", 4, 2, schedule="loop")
    assert loop == pytest.approx(2 * predict(parts.scaled(0.5), 0.06, "pipeline", 4))
    for schedule in ("lockstep", "1f1b"):
        assert predict(parts, 0.0, "pipeline", 4, 2, schedule=schedule) == pytest.approx(0.18)
        assert 0.18 <= predict(parts, 0.12, "pipeline", 4, 2, schedule=schedule) < loop, schedule
        # turns that follow the transfers (a what-if: a process group per micro-batch): between the compute
        # and the loop (greedy, so not always below the turns at every wait)
        wc = predict(parts, 0.12, "pipeline", 4, 2, schedule=schedule, work_conserving=True)
        assert 0.18 <= wc <= loop + 1e-9, schedule
        assert predict(parts, 0.0, "pipeline", 4, 2, schedule=schedule, work_conserving=True) == pytest.approx(0.18)
    with pytest.raises(ValueError, match="schedule must be one of"):
        predict(parts, 0.1, "pipeline", 4, 2, schedule="dualpipe")


def test_overlap_simulator_predicts_each_measured_mode_within_15_percent():
    """The committed bench_overlap run: each mode's step predicted from that run's own measured parts."""
    from pathlib import Path

    from fmoe.perf.overlap_model import compare_with_bench
    bench = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/overlap-cpu.json").read_text())
    rows = compare_with_bench(bench)
    assert {r["mode"] for r in rows} >= {"none", "shared", "pipeline", "auto", "two micro-batches"}
    assert {r["world"] for r in rows} == {2, 4}
    worst = max(rows, key=lambda r: abs(r["error"]))
    assert abs(worst["error"]) <= 0.15, worst


@pytest.mark.parametrize("world, ep_size", [(2, 2), (4, 2)])
def test_overlap_modes_under_fsdp2_equal_none(world, ep_size):
    run_ranks(overlap_workers.check_overlap_modes_equal_none_under_fsdp2, world, ep_size)


def test_overlap_interleaved_compiled_model_equals_one_after_the_other():
    run_ranks(overlap_workers.check_interleaved_compiled_equals_one_after_the_other, 2)
