"""FastMoE path `fmoe.fastermoe.config`: reading FasterMoE's environment switches."""
import os


def float_from_env(key, default=-1):
    return float(os.environ[key]) if key in os.environ else default


def switch_from_env(key, default=False):
    return os.environ[key] in ("1", "ON") if key in os.environ else default
