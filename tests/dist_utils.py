"""Run a function on N real processes with gloo (torch.multiprocessing.spawn)."""
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free right now, for launchers that rendezvous over TCP (DeepSpeed's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, store_file, fn, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    # A file rendezvous: no TCP port to pick, so no clash with anything else running here.
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size)
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
