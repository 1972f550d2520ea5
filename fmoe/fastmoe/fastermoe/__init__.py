"""FastMoE path `fmoe.fastermoe`: FasterMoE's switches and its scheduled forward.

fmoe's FasterMoE lives in `fmoe.distributed.schedule` / `.shadow` and `fmoe.perf.perfmodel`; these
modules only give FastMoE's import paths.
"""
