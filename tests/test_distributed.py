"""Expert parallelism with real processes (gloo) against the single-process layer."""
import pytest

from tests import dist_workers
from tests.dist_utils import run_ranks


@pytest.mark.parametrize("world", [2, 4])
def test_layer_equals_single_process(world):
    run_ranks(dist_workers.check_layer_matches_single_process, world)


@pytest.mark.parametrize("world,ep_size,mode", [(2, 2, "dgdp"), (2, 2, "ddp"), (4, 2, "dgdp"), (4, 2, "ddp")])
def test_training_equals_single_process(world, ep_size, mode):
    run_ranks(dist_workers.check_training_matches_single_process, world, ep_size, mode)


def test_mismatched_ranks_raise_on_every_rank():
    run_ranks(dist_workers.check_mismatch_raises, 2)


def test_checkpoint_reshards_4_2_1_4(tmp_path):
    run_ranks(dist_workers.reshard_stage, 4, 0, str(tmp_path))
    run_ranks(dist_workers.reshard_stage, 2, 1, str(tmp_path))
    dist_workers.reshard_stage(0, 1, 2, str(tmp_path))
    run_ranks(dist_workers.reshard_stage, 4, 3, str(tmp_path))


def test_missing_rank_fails_with_a_message_not_a_hang():
    run_ranks(dist_workers.check_missing_rank_times_out, 2)


def test_balanced_gate_bias_agrees_across_ranks():
    run_ranks(dist_workers.check_balanced_gate_bias_follows_global_load, 2)


# --- gloo's mesh connect, retried on every rank (tests/dist_utils.py: init_gloo_with_retry) -------------

def _flaky_init(rank, calls, fail_on_rank_1):
    """torch's init_process_group, counted in `calls`; on rank 1, `fail_on_rank_1(attempt)` may say to
    fail the attempt "before" gloo connects (its peer then times out for real) or "after" (the peer's
    mesh came up), with gloo's words for a refused pair."""
    import torch.distributed.distributed_c10d as c10d

    def init(*args, **kwargs):
        calls.append(kwargs["store"])
        when = fail_on_rank_1(len(calls)) if rank == 1 else None
        refused = RuntimeError("[gloo/transport/tcp/pair.cc:144] connect [127.0.0.1]:45678: Connection refused "
                               f"(injected, attempt {len(calls)})")
        if when == "before":
            raise refused
        c10d.init_process_group(*args, **kwargs)
        if when == "after":
            raise refused
        if when == "fatal":
            raise ValueError(f"not a connect failure (injected, attempt {len(calls)})")
    return init


def _gloo_retry_cases(rank, world, folder, cases):
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from tests.dist_utils import exit_without_teardown, init_gloo_with_retry

    torch.set_num_threads(1)
    for case in cases:
        calls = []
        fail = {"refused_before_connect": lambda n: "before" if n == 1 else None,
                "refused_after_peer_connected": lambda n: "after" if n == 1 else None,
                "refused_every_attempt": lambda n: "after",
                "not_a_connect_failure": lambda n: "fatal"}[case]
        store = dist.FileStore(f"{folder}/{case}", world)
        setup = dict(timeout=timedelta(seconds=90), connect_timeout=timedelta(seconds=5),
                     init=_flaky_init(rank, calls, fail))
        if case in ("refused_before_connect", "refused_after_peer_connected"):
            assert init_gloo_with_retry(rank, world, store, **setup) == 2, case
            assert len(calls) == 2 and len({id(s) for s in calls}) == 2, case    # a fresh store per attempt
            t = torch.tensor([rank + 1.0])
            dist.all_reduce(t)
            assert t.item() == 3.0, case
            pair = dist.new_group([0, 1])    # named by the group counter: equal on both ranks after a retry
            dist.all_reduce(t, group=pair)
            assert t.item() == 6.0, case
            backend = dist.group.WORLD._get_backend(torch.device("cpu"))
            assert backend.options._timeout == timedelta(seconds=90), case    # not the attempt's 5 s
            dist.destroy_process_group()
            continue
        try:
            init_gloo_with_retry(rank, world, store, **setup)
        except Exception as err:  # noqa: BLE001
            error = err
        else:
            raise AssertionError(f"{case}: rank {rank} made a group")
        assert not dist.is_initialized() and c10d._world.group_count == 0, case
        if case == "refused_every_attempt":
            assert len(calls) == 3, (case, len(calls))
            assert isinstance(error, RuntimeError) and "not connected after 3 attempts" in str(error), error
            assert "rank 1: retry: RuntimeError" in str(error) and "attempt 3)" in str(error), error
            assert rank == 0 or "Connection refused (injected, attempt 3)" in str(error.__cause__), error.__cause__
        else:
            assert len(calls) == 1, (case, len(calls))
            if rank == 1:
                assert isinstance(error, ValueError) and "injected, attempt 1" in str(error), error
            else:
                assert "failed on another rank" in str(error) and "rank 1: fatal: ValueError" in str(error), error
    exit_without_teardown()


def _run_gloo_retry_cases(tmp_path, *cases):
    import torch.multiprocessing as mp

    mp.spawn(_gloo_retry_cases, args=(2, str(tmp_path), cases), nprocs=2, join=True)


def test_gloo_refused_connect_on_one_rank_is_retried_on_both(tmp_path):
    """Rank 1's first connect is refused, before its mesh is up (rank 0's times out for real) or after
    rank 0's came up: both ranks retry together on a fresh store; the group then works."""
    _run_gloo_retry_cases(tmp_path, "refused_before_connect", "refused_after_peer_connected")


def test_gloo_connect_retry_is_bounded_and_other_errors_are_not_retried(tmp_path):
    """A refused connect on every attempt: both ranks give up after 3, with the last error; any other
    error: no retry, raised on its rank, named on the other."""
    _run_gloo_retry_cases(tmp_path, "refused_every_attempt", "not_a_connect_failure")
