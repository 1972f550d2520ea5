"""FasterMoE: performance model, shadowing policy, shadowing (real processes)."""
from dataclasses import replace

import pytest
import torch

from fmoe.perf.perfmodel import PerfModel
from tests import shadow_workers
from tests.dist_utils import run_ranks


def test_model_times_match_hand_computation():
    m = PerfModel(d_model=4, d_hidden=8, flops=100.0, net_bandwidth=10.0, bytes_per_element=1)
    counts = torch.tensor([[3, 1, 0, 0], [5, 0, 1, 2]])       # 2 workers, experts 0-1 on w0, 2-3 on w1
    # w0 processes experts 0, 1: 8 + 1 = 9 rows; w1 processes 2, 3: 1 + 2 = 3 rows.
    assert m.worker_rows(counts).tolist() == [9.0, 3.0]
    per_row = 3 * 4 * 2 * 16 / 100 + 4 * 4 / 10               # compute + traffic of one row
    assert m.layer_time(counts) == pytest.approx(9 * per_row)
    # Shadowing expert 0: w0 keeps its own 3 rows of it + 1 of expert 1; w1 its own 5 + 3.
    assert m.worker_rows(counts, [0]).tolist() == [4.0, 8.0]
    assert m.layer_time(counts, [0]) == pytest.approx(8 * per_row + 2 * 1 * 2 * 2 * 16 / 10)


def test_fixed_costs_and_separate_pull_push_bandwidths_by_hand():
    m = PerfModel(d_model=4, d_hidden=8, flops=100.0, net_bandwidth=10.0, bytes_per_element=1,
                  time_per_expert=0.5, pull_bandwidth=20.0, push_bandwidth=5.0, overhead_per_row=0.01)
    counts = torch.tensor([[3, 1, 0, 0], [5, 0, 1, 2]])
    per_row = 3 * 4 * 2 * 16 / 100 + 4 * 4 / 10
    own_rows = 8                                              # w1 routes 8 rows, w0 4
    # Off: w0 runs its 2 experts over 9 rows.
    assert m.layer_time(counts) == pytest.approx(9 * per_row + 2 * 0.5 + 0.01 * own_rows)
    # Expert 0 shadowed: w1 runs 3 experts (its 2 and the pulled one) over 8 rows; one expert's
    # 2 * 2 * 16 bytes go out at 20 B/s and come back at 5 B/s.
    assert m.layer_time(counts, [0]) == pytest.approx(8 * per_row + 3 * 0.5 + 64 / 20 + 64 / 5 + 0.01 * own_rows)
    # A measured cost per shadowed expert replaces the modelled transfers.
    measured = replace(m, shadow_time_per_expert=7.0)
    assert measured.layer_time(counts, [0]) == pytest.approx(8 * per_row + 3 * 0.5 + 7.0 + 0.01 * own_rows)
    assert measured.shadow_cost(3) == pytest.approx(21.0)


def test_probes_take_turns_after_their_warmup():
    from fmoe.perf.calibration import time_in_turns
    order = []
    steps = {name: (lambda name=name: order.append(name)) for name in "abc"}
    times = time_in_turns(steps, reps=4, warmup=1)
    # One warmup each in order, then rounds of every step once, in orders that differ.
    assert order[:3] == list("abc")
    rounds = ["".join(order[i:i + 3]) for i in range(3, 15, 3)]
    assert all(sorted(r) == list("abc") for r in rounds) and len(set(rounds)) > 1, rounds
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4, "c": 4}
    more = time_in_turns({"a": lambda: None}, reps=2, warmup=0, times=times)    # a later round appends
    assert more is times and len(times["a"]) == 6


def test_expert_curve_sums_each_workers_experts_at_their_rows_by_hand():
    # One expert: 1 s with no rows, +0.25 s a row up to 4 rows, +1 s a row from 4 to 8 and beyond.
    m = PerfModel(d_model=4, d_hidden=8, net_bandwidth=float("inf"), shadow_time_per_expert=0.5,
                  expert_seconds=((0, 1.0), (4, 2.0), (8, 6.0)))
    assert m.expert_time(torch.tensor([0, 1, 4, 5, 8, 10])).tolist() == [1.0, 1.25, 2.0, 3.0, 6.0, 8.0]
    counts = torch.tensor([[3, 1, 0, 0], [5, 0, 1, 2]])
    # Off: w0 runs expert 0 over 8 rows and expert 1 over 1; w1 runs 2 and 3 over 1 and 2.
    assert m.layer_time(counts) == pytest.approx(max(6.0 + 1.25, 1.25 + 1.5))
    # Expert 0 shadowed: w0 keeps its 3 rows of it, w1 runs it too over its own 5 rows.
    assert m.layer_time(counts, [0]) == pytest.approx(max(1.75 + 1.25, 3.0 + 1.25 + 1.5) + 0.5)
    assert m.choose_shadowed(counts) == [0]
    assert replace(m, shadow_time_per_expert=1.5).choose_shadowed(counts) == []     # no longer falls


def test_calibration_fit_recovers_the_expert_curve_the_steps_were_made_of():
    from fmoe.perf.calibration import Calibration, expert_levels
    calibration = Calibration(PerfModel(64, 256), size=256, num_expert=4)
    assert calibration.levels == expert_levels(256, 4) == [(16, 4), (64, 4), (256, 1), (512, 1)]

    def one_expert(rows):                       # convex: a row costs more the more rows an expert holds
        return 3e-4 + 2e-6 * rows + 1e-9 * rows ** 2
    seconds = {"expert_rows_0": 4 * one_expert(0)}
    seconds.update({f"expert_rows_{rows}": given * one_expert(rows) + (4 - given) * one_expert(0)
                    for rows, given in calibration.levels})
    fitted = calibration.fit(seconds)
    assert [r for r, _ in fitted.expert_seconds] == [0, 16, 64, 256, 512]
    assert [t for _, t in fitted.expert_seconds] == pytest.approx([one_expert(r) for r in (0, 16, 64, 256, 512)])
    # FasterMoE's constants: the line from the balanced 64 rows per expert to the next level.
    per_row = (one_expert(256) - one_expert(64)) / 192
    assert fitted.flops == pytest.approx(3 * 4 * 4 * 64 ** 2 / per_row)
    assert fitted.time_per_expert == pytest.approx(one_expert(64) - 64 * per_row)
    assert set(calibration.probes()) == {"expert_rows_0", "expert_rows_16", "expert_rows_64", "expert_rows_256",
                                         "expert_rows_512"}      # one process: no transfers
    with pytest.raises(ValueError, match="expert_rows_512"):
        calibration.fit({"expert_rows_0": 1.0})


def test_calibration_on_two_ranks_measures_every_constant():
    run_ranks(shadow_workers.check_calibration_measures_every_constant_alike_on_all_ranks, 2)


def test_paired_difference_is_the_median_of_round_by_round_differences_by_hand():
    from fmoe.perf.calibration import paired_difference
    # Rounds 4-5 ran slow for both and round 3's first step met a spike: the medians' difference
    # would say 2.0 - 1.0 = 1.0.
    assert paired_difference([1.2, 1.2, 2.0, 2.2, 2.2], [1.0, 1.0, 1.0, 2.0, 2.0]) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="one time per round on both sides, got 2 and 1"):
        paired_difference([1.0, 2.0], [1.0])


def test_calibration_takes_shadowings_cost_round_by_round_on_two_ranks():
    run_ranks(shadow_workers.check_fit_times_takes_shadowings_cost_round_by_round, 2)


def test_policy_uniform_shadows_nothing_and_hot_expert_is_shadowed():
    m = PerfModel(d_model=1024, d_hidden=4096, flops=1e12, net_bandwidth=10e9)
    uniform = torch.full((4, 8), 500)
    assert m.choose_shadowed(uniform) == []
    hot = torch.full((4, 8), 100)
    hot[:, 3] = 4000
    assert m.choose_shadowed(hot) == [3]
    # Mild skew on a fast GPU: moving the parameters costs more than the imbalance.
    mild = torch.full((4, 8), 100)
    mild[:, 3] = 400
    assert m.choose_shadowed(mild) == [3]
    assert PerfModel(1024, 4096, flops=1e15, net_bandwidth=10e9).choose_shadowed(mild) == []


@pytest.mark.parametrize("world", [2, 4])
def test_shadowing_equals_plain_expert_parallelism(world):
    run_ranks(shadow_workers.check_shadowing_equals_plain, world)


def test_overlapped_pull_and_push_are_bitwise_blocking():
    run_ranks(shadow_workers.check_overlap_is_bitwise_blocking, 2)


@pytest.mark.parametrize("world", [2, 4])
def test_user_and_gated_experts_shadow_with_and_without_schedule(world):
    run_ranks(shadow_workers.check_any_expert_shadowing_equals_plain, world)


def test_real_policy_shadows_the_hot_expert():
    run_ranks(shadow_workers.check_policy_shadows_a_hot_expert, 2)


@pytest.mark.parametrize("world", [2, 4])
def test_scheduling_equals_plain_expert_parallelism(world):
    run_ranks(shadow_workers.check_schedule_equals_plain, world)


def test_schedule_model_hand_values():
    from fmoe.perf.perfmodel import pipeline_time
    assert pipeline_time([1.0, 2.0, 1.0], 1) == 4.0
    assert pipeline_time([1.0, 2.0, 1.0], 4) == pytest.approx(4 / 4 + 3 * 2 / 4)
    m = PerfModel(d_model=4, d_hidden=8, flops=100.0, net_bandwidth=10.0, bytes_per_element=1)
    counts = torch.tensor([[3, 1, 0, 0], [5, 0, 1, 2]])
    assert m.layer_time(counts, schedule_steps=1) == pytest.approx(m.layer_time(counts))
    comp, traf = m.compute_time(9), m.traffic_time(9)
    expected = (pipeline_time([traf / 4, comp / 3, traf / 4], 2) + pipeline_time([traf / 4, 2 * comp / 3, traf / 4], 2))
    assert m.layer_time(counts, schedule_steps=2) == pytest.approx(expected)
    assert m.layer_time(counts, schedule_steps=2) < m.layer_time(counts)


def test_simulate_writes_table_json_and_plot(tmp_path, capsys):
    import json
    from fmoe.perf import simulate
    simulate.main(["--gpus", "8", "64", "--dist", "uniform", "zipf:1.2", "hot:0.5", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "simulate.json").read_text())
    rows = {(r["distribution"], r["gpus"]): r for r in data["results"]}
    assert rows[("uniform", 8)]["speedup"]["shadow"] == pytest.approx(1.0)
    assert rows[("hot:0.5", 64)]["speedup"]["shadow"] > 2
    assert all(r["speedup"]["both"] >= r["speedup"]["shadow"] - 1e-9 for r in data["results"])
    assert (tmp_path / "simulate.png").stat().st_size > 1000
    assert "hot:0.5" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--dist"):
        simulate.expert_shares("zipf:-1", 8)


def test_noise_ceiling_is_the_share_of_variance_between_same_work_variants_by_hand():
    from fmoe.perf.simulate import noise_ceiling
    points = [{"case": "hot", "shadowed": [], "measured_s": 1.0},
              {"case": "hot", "shadowed": [0], "measured_s": 2.0},
              {"case": "hot", "shadowed": [0], "measured_s": 2.2},       # the same work as the one above
              {"case": "uniform", "shadowed": [], "measured_s": 3.0}]
    # Pooled noise variance 0.1^2 + 0.1^2 over 1 degree of freedom = 0.02; the times' variance 2.03 / 4.
    assert noise_ceiling(points) == pytest.approx(1 - 0.02 / (2.03 / 4))
    assert noise_ceiling(points[:2]) is None                            # no two variants did the same work


def test_simulate_compares_with_a_bench_run_and_sets_paper_clusters(tmp_path, capsys):
    import json
    from fmoe.perf import simulate
    model = PerfModel(32, 64, flops=1e9, net_bandwidth=1e8)
    counts = {"uniform": [[8, 8, 8, 8], [8, 8, 8, 8]], "hot": [[20, 4, 4, 4], [20, 4, 4, 4]]}
    results = {}
    for case, c in counts.items():
        c_WE = torch.tensor(c)
        results[case] = {"counts_WE": c, "off_s": model.layer_time(c_WE),
                         "dynamic_s": model.layer_time(c_WE, model.choose_shadowed(c_WE)),
                         "forced_s": model.layer_time(c_WE, [0])}
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"config": {"d_model": 32, "d_hidden": 64}, "results": results,
                                 "model": {"flops": 1e9, "net_bandwidth": 1e8}}))
    simulate.main(["--gpus", "16", "--dist", "zipf:1.2", "--compare", str(bench), "--paper", "--out", str(tmp_path)])
    compared = json.loads((tmp_path / "compare.json").read_text())
    assert compared["r_squared"] == pytest.approx(1.0) and len(compared["points"]) == 6
    # The hot case's dynamic and forced steps shadow the same expert (same work, same time): no
    # noise between them, so a perfect model is not capped.
    assert [p["shadowed"] for p in compared["points"]] == [[], [], [0], [], [0], [0]]
    assert compared["r_squared_noise_ceiling"] == pytest.approx(1.0)
    assert (tmp_path / "compare.png").stat().st_size > 1000
    paper = json.loads((tmp_path / "simulate.json").read_text())["paper"]
    assert [r["gpus"] for r in paper] == [16, 64]
    assert paper[1]["speedup"]["both"] > paper[0]["speedup"]["both"] > 1      # the gain grows with the cluster
    assert "R^2 = 1.000" in capsys.readouterr().out


@pytest.mark.parametrize("world", [2, 4])
def test_shadowing_inside_deepspeed_equals_off(world):
    pytest.importorskip("deepspeed")
    from tests.test_deepspeed import run_deepspeed_ranks
    run_deepspeed_ranks(shadow_workers.check_deepspeed_shadowing_equals_off, world)


@pytest.mark.parametrize("world", [2, 4])
def test_shadowing_inside_megatron_equals_off(world):
    pytest.importorskip("megatron.core")
    run_ranks(shadow_workers.check_megatron_shadowing_equals_off, world)


def test_a_policy_naming_an_unknown_expert_is_refused_by_name():
    from fmoe.distributed.shadow import ShadowPolicy
    from fmoe.routing import RoutingPlan

    class Wrong(ShadowPolicy):
        def __init__(self, experts):
            super().__init__(PerfModel(8, 16))
            self.experts = experts

        def choose(self, counts_E, world_size, group=None):
            return self.experts

    idx = torch.tensor([[0], [1], [3]])
    for experts in ([4], [-1], [1, 1]):
        with pytest.raises(ValueError, match=r"Wrong.choose returned .* distinct expert ids in \[0, 4\)"):
            RoutingPlan.build(idx, 4, world_size=2, shadow_policy=Wrong(experts))


def test_pulled_copies_are_freed_after_each_step():
    run_ranks(shadow_workers.check_pulled_copies_are_freed, 2)


def test_shadowing_keeps_its_buffers_across_steps_and_never_shares_one_in_use():
    run_ranks(shadow_workers.check_kept_buffers_are_reused_and_never_shared, 2)


def test_buffer_pool_hands_out_a_kept_buffer_only_when_nothing_holds_it():
    from fmoe.distributed.shadow import BufferPool
    pool = BufferPool(per_tag=2)
    like = torch.zeros(1)
    a = pool.take("pull:0", 100, like)
    ptr = a.data_ptr()
    b = pool.take("pull:0", 100, like)          # `a` is still held: another buffer
    assert b.data_ptr() != ptr and pool.nbytes == 2 * 100 * 4
    c = pool.take("pull:0", 100, like)          # both held, the pool is full: fresh and not kept
    assert c.data_ptr() not in (ptr, b.data_ptr()) and len(pool.buffers["pull:0"]) == 2
    view = a[10:20]
    del a, c
    assert pool.take("pull:0", 100, like).data_ptr() != ptr     # a view of `a` still holds it
    del view
    again = pool.take("pull:0", 60, like)       # free again: the same memory, only as long as asked
    assert again.data_ptr() == ptr and again.shape == (60,) and not again._is_view()
    del again, b
    grown = pool.take("pull:0", 300, like)      # more than it holds: replaced by a larger one
    assert grown.numel() == 300 and pool.nbytes == (300 + 100) * 4
    assert pool.take("pull:0", 10, torch.zeros(1, dtype=torch.float64)).dtype == torch.float64
    pool.clear()
    assert pool.nbytes == 0
