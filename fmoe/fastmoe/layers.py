"""FastMoE path `fmoe.layers`: the layer, the parallel-comm tags and the general forward."""
from fmoe.fastmoe.functions import general_global_forward as _fmoe_general_global_forward
from fmoe.layer import FMoE


def mark_module_parallel_comm(module, comm):
    """Tag every parameter of `module` to be data-parallel reduced over `comm` ("world", "dp", "none", ...)."""
    for p in module.parameters():
        p.dp_comm = comm


__all__ = ["FMoE", "mark_module_parallel_comm", "_fmoe_general_global_forward"]
