"""Run a function on N real processes with gloo (torch.multiprocessing.spawn), and set up gloo groups
in tests with a bounded retry of gloo's connect (`init_gloo_with_retry`)."""
import os
import socket
import sys
import tempfile
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp

GLOO_CONNECT_ATTEMPTS = 3
GLOO_CONNECT_TIMEOUT = timedelta(seconds=60)
# What gloo's full-mesh connect (or the store wait inside it) says when a pair does not come up:
# a refused or reset connection, a connect or key wait that timed out.
_CONNECT_FAILURES = ("connection refused", "connection reset", "connectfullmesh", "broken pipe", "timed out",
                     "timeout")


def free_port() -> int:
    """A TCP port free right now, for launchers that rendezvous over TCP (DeepSpeed's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_gloo_connect_failure(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and any(s in str(err).lower() for s in _CONNECT_FAILURES)


def init_gloo_with_retry(rank: int, world_size: int, store, timeout: Optional[timedelta] = None,
                         attempts: int = GLOO_CONNECT_ATTEMPTS, connect_timeout: timedelta = GLOO_CONNECT_TIMEOUT,
                         init=None) -> int:
    """`dist.init_process_group("gloo")` over `store`, retried on every rank together when gloo's mesh
    connect fails (a refused or reset pair, a connect timeout), at most `attempts` times; returns the
    attempt that connected.

    Every attempt runs on a fresh `PrefixStore` of `store` (no rank reads a failed attempt's addresses)
    under `connect_timeout`; each rank then posts its outcome in `store` and waits for every rank's.
    Only when all connected does a rank keep its group: one whose own mesh came up while a peer's did
    not destroys it and retries with the peer. Any other error on any rank ends the setup on every rank
    (that rank re-raises its own error); after `attempts` failed connects every rank raises, naming the
    last failures. The group keeps `timeout` (torch's default when None) for its collectives.
    `init` (default: torch's init_process_group) is for the tests of this retry."""
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    init = init or c10d.init_process_group
    final = timeout or c10d._get_default_timeout(dist.Backend.GLOO)
    per_attempt = min(connect_timeout, final)
    agree = per_attempt * 2 + timedelta(seconds=30)      # a late peer's own connect, then its post

    def outcome_keys(attempt):
        return [f"fmoe-tests/gloo-outcome/{attempt}/{r}" for r in range(world_size)]

    for attempt in range(1, attempts + 1):
        group_count = c10d._world.group_count
        store.set_timeout(per_attempt)
        error = None
        try:
            init("gloo", store=dist.PrefixStore(f"fmoe-tests/gloo-attempt-{attempt}/", store), rank=rank,
                 world_size=world_size, timeout=per_attempt)
            outcome = "ok"
        except Exception as err:  # noqa: BLE001 - posted to the peers, then retried or re-raised
            error = err
            outcome = ("retry" if is_gloo_connect_failure(err) else "fatal") + f": {type(err).__name__}: {err}"
        keys = outcome_keys(attempt)
        store.set(keys[rank], outcome)
        try:
            store.wait(keys, agree)
            outcomes = [store.get(k).decode() for k in keys]
        except Exception as err:  # noqa: BLE001 - a peer that never posts: it died or hangs
            _undo(group_count)
            raise RuntimeError(f"rank {rank}: gloo connect attempt {attempt}: a peer did not post its outcome "
                               f"within {agree} (this rank's: {outcome})") from err
        if all(o == "ok" for o in outcomes):
            c10d._set_pg_timeout(final)
            store.set_timeout(final)
            return attempt
        _undo(group_count)
        if outcome.startswith("fatal"):
            raise error
        failed = "; ".join(f"rank {r}: {o}" for r, o in enumerate(outcomes) if o != "ok")
        if "fatal" in (o.split(":")[0] for o in outcomes):
            raise RuntimeError(f"rank {rank}: gloo group setup failed on another rank: {failed}")
        if attempt == attempts:
            raise RuntimeError(f"rank {rank}: gloo group of {world_size} ranks not connected after {attempts} "
                               f"attempts; the last: {failed}") from error


def _undo(group_count: int):
    """Leave no trace of a failed attempt: its group (made on this rank, not on a peer) and the group
    counter it advanced, which names the next groups and must stay equal on every rank."""
    if dist.is_initialized():
        dist.destroy_process_group()
    c10d._world.group_count = group_count


def init_gloo_from_env(timeout: Optional[timedelta] = None, **kwargs):
    """`init_gloo_with_retry` over env:// as torchrun sets it (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE):
    rank 0 serves the TCPStore."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    final = timeout or c10d._get_default_timeout(dist.Backend.GLOO)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0, timeout=final)
    return init_gloo_with_retry(rank, world_size, store, timeout=timeout, **kwargs)


def retry_gloo_init_in_this_process():
    """Make `torch.distributed.init_process_group("gloo")` over env:// (as fmoe's `init_distributed`
    calls it under torchrun) go through `init_gloo_from_env` in this (spawned) process."""

    def init_process_group(backend=None, init_method=None, timeout=None, **kwargs):
        if backend != "gloo" or init_method not in (None, "env://") or kwargs:
            return c10d.init_process_group(backend, init_method=init_method, timeout=timeout, **kwargs)
        init_gloo_from_env(timeout)

    dist.init_process_group = init_process_group


def _entry(rank, world_size, store_file, fn, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    # A file rendezvous: no TCP port to pick, so no clash with anything else running here.
    init_gloo_with_retry(rank, world_size, dist.FileStore(store_file, world_size))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    exit_without_teardown()


def exit_without_teardown():
    """Leave a finished rank at once. torch 2.13's gloo sometimes aborts in its own teardown at
    interpreter exit ("terminate called without an active exception") after all work is done;
    skipping the teardown keeps a passing rank from being reported as killed by SIGABRT."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args):
    """fn(rank, world_size, *args) on `world_size` processes; an exception on any rank fails the call."""
    with tempfile.TemporaryDirectory(prefix="fmoe-rendezvous-") as folder:
        mp.spawn(_entry, args=(world_size, os.path.join(folder, "store"), fn, args), nprocs=world_size, join=True)


def assert_expert_parallel_grads(ep, full, rank: int, per_rank: int, what: str, atol: float, rtol: float):
    """An expert-parallel layer's gradients equal the one-process layer's: its experts' to the rows of
    `full`'s that this rank holds (`per_rank` experts a rank), its gate's summed over the ranks."""
    import torch
    import torch.distributed as dist
    for name, p in ep.experts.named_parameters():
        ref = getattr(full.experts, name).grad[rank * per_rank:(rank + 1) * per_rank]
        torch.testing.assert_close(p.grad, ref, atol=atol, rtol=rtol, msg=lambda m: f"{what} {name}: {m}")
    for (name, p), (_, q) in zip(ep.gate.named_parameters(), full.gate.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, q.grad, atol=atol, rtol=rtol, msg=lambda m: f"{what} gate {name}: {m}")
