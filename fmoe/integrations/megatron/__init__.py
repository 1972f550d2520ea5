"""fmoe inside Megatron-Core: MoE layers for its MLP slot, GPT layer specs, `fmoefy`, and CPU support.

    from fmoe.integrations.megatron import get_gpt_layer_with_fmoe_spec, fmoefy
    spec = get_gpt_layer_with_fmoe_spec(gate="gshard")       # a new model, or
    fmoefy(gpt_model, num_experts=8, top_k=2, gate="gshard")   # an existing one

`fmoe.integrations.megatron.cpu_compat.apply()` lets Megatron-Core run on a machine without CUDA (gloo);
`fmoe.integrations.megatron.training` has the small training harness the examples and tests use.
"""
import warnings

try:
    import megatron.core
except ImportError as err:
    raise ImportError("fmoe.integrations.megatron needs megatron-core: pip install 'fmoe[megatron]'") from err

from fmoe.integrations.megatron.balance import (add_balance_log, generate_megatron_gate_hook, get_balance_profile,
                                                reset_gate_hook)
from fmoe.integrations.megatron.checkpoint import load_checkpoint, save_checkpoint
from fmoe.integrations.megatron.distributed import DistributedDataParallel
from fmoe.integrations.megatron.fmoefy import fmoefy
from fmoe.integrations.megatron.mlp import MegatronMLP
from fmoe.integrations.megatron.patch import patch_forward_step, patch_model_provider
from fmoe.integrations.megatron.spec import fmoe_mlp_spec, get_gpt_layer_with_fmoe_spec
from fmoe.integrations.megatron.utils import add_fmoe_args

TESTED_MEGATRON_CORE = ("0.16.1", "0.19.2")
"""The megatron-core releases fmoe.megatron is tested with; importing it with another one warns."""

if megatron.core.__version__.split("+")[0] not in TESTED_MEGATRON_CORE:
    warnings.warn(f"fmoe.integrations.megatron is tested with megatron-core {', '.join(TESTED_MEGATRON_CORE)}; "
                  f"this is {megatron.core.__version__}")

__all__ = ["MegatronMLP", "fmoefy", "fmoe_mlp_spec", "get_gpt_layer_with_fmoe_spec", "TESTED_MEGATRON_CORE",
           # FastMoE's Megatron-LM helpers (see {utils,balance,checkpoint,patch,distributed}.py here)
           "add_fmoe_args", "save_checkpoint", "load_checkpoint", "DistributedDataParallel", "reset_gate_hook",
           "get_balance_profile", "generate_megatron_gate_hook", "add_balance_log", "patch_forward_step",
           "patch_model_provider"]
