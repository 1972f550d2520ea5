"""Bounded waits: every collective fmoe issues gives up after a timeout with a message naming
the layer and the collective, instead of waiting forever on a rank that stopped or died.

The bound is `FMOE_COLLECTIVE_TIMEOUT` seconds (default 300). Collectives are issued
asynchronously and waited on with that timeout, which gloo and NCCL both honour; the process
groups `make_groups` builds carry it too, so collectives issued elsewhere on them are bounded.
"""
import threading
from datetime import timedelta

from fmoe.env import env_float

DEFAULT_SECONDS = 300.0


def collective_timeout() -> timedelta:
    return timedelta(seconds=env_float("FMOE_COLLECTIVE_TIMEOUT", DEFAULT_SECONDS))


def wait(work, what: str):
    """Wait for an async collective's `work`; `what` names the layer and the collective."""
    if work is None:
        return
    timeout = collective_timeout()
    try:
        work.wait(timeout=timeout)
    except RuntimeError as err:
        raise RuntimeError(
            f"fmoe: {what} did not complete within {timeout.total_seconds():g} s (FMOE_COLLECTIVE_TIMEOUT): "
            f"a rank of its group stopped, died or took another path ({err})"
        ) from err


_current = threading.local()     # per thread: interleaved micro-batches run in threads of their own


def set_current_layer(name: str):
    """Names the layer whose collectives run now, for the messages above. The layer sets it as its
    forward begins; an exchange plan keeps the name for its backward."""
    _current.layer = name


def current_layer() -> str:
    return getattr(_current, "layer", "an fmoe layer")
