"""fmoe's environment variables, parsed in one place: a bad value names its variable."""
import math
import os

import torch

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("", "0", "false", "off", "no")


@torch.compiler.assume_constant_result
def env_raw(name: str) -> "str | None":
    """The variable's text, or None; a compiled graph keeps what it read when traced (Dynamo before
    torch 2.5 cannot trace `os.environ`)."""
    return os.environ.get(name)


def env_flag(name: str, default: bool = False) -> bool:
    raw = env_raw(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"environment variable {name} must be one of {_TRUE + _FALSE[1:]}, got {raw!r}")
    return value in _TRUE


def env_int(name: str, default: int, minimum: int = 1) -> int:
    raw = env_raw(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"environment variable {name} must be >= {minimum}, got {value}")
    return value


def env_float(name: str, default: float, positive: bool = True) -> float:
    """A finite number (> 0 when `positive`), e.g. seconds or FLOP/s."""
    raw = env_raw(name)
    if raw is None:
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name} must be a number, got {raw!r}") from None
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"environment variable {name} must be a finite number{' > 0' if positive else ''}, "
                         f"got {raw!r}")
    return value


def env_choice(name: str, choices) -> "str | None":
    raw = env_raw(name)
    if raw is None or raw == "":
        return None
    if raw not in choices:
        raise ValueError(f"environment variable {name} must be one of {tuple(choices)}, got {raw!r}")
    return raw
