"""fmoe inside Megatron-Core: MoE layers for its MLP slot, GPT layer specs, `fmoefy`, and CPU support.

    from fmoe.megatron import get_gpt_layer_with_fmoe_spec, fmoefy
    spec = get_gpt_layer_with_fmoe_spec(gate="gshard")       # a new model, or
    fmoefy(gpt_model, num_experts=8, top_k=2, gate="gshard")   # an existing one

`fmoe.megatron.cpu_compat.apply()` lets Megatron-Core run on a machine without CUDA (gloo);
`fmoe.megatron.training` has the small training harness the examples and tests use.
"""
import warnings

try:
    import megatron.core
except ImportError as err:
    raise ImportError("fmoe.megatron needs megatron-core: pip install 'fmoe[megatron]'") from err

from fmoe.megatron.balance import add_balance_log, generate_megatron_gate_hook, get_balance_profile, reset_gate_hook
from fmoe.megatron.checkpoint import load_checkpoint, save_checkpoint
from fmoe.megatron.distributed import DistributedDataParallel
from fmoe.megatron.fmoefy import fmoefy
from fmoe.megatron.mlp import MegatronMLP
from fmoe.megatron.patch import patch_forward_step, patch_model_provider
from fmoe.megatron.spec import fmoe_mlp_spec, get_gpt_layer_with_fmoe_spec
from fmoe.megatron.utils import add_fmoe_args

TESTED_MEGATRON_CORE = ("0.16.1", "0.19.2")
"""The megatron-core releases fmoe.megatron is tested with; importing it with another one warns."""

if megatron.core.__version__.split("+")[0] not in TESTED_MEGATRON_CORE:
    warnings.warn(f"fmoe.megatron is tested with megatron-core {', '.join(TESTED_MEGATRON_CORE)}; "
                  f"this is {megatron.core.__version__}")

__all__ = ["MegatronMLP", "fmoefy", "fmoe_mlp_spec", "get_gpt_layer_with_fmoe_spec", "TESTED_MEGATRON_CORE",
           # FastMoE's Megatron-LM helpers (see fmoe/megatron/{utils,balance,checkpoint,patch,distributed}.py)
           "add_fmoe_args", "save_checkpoint", "load_checkpoint", "DistributedDataParallel", "reset_gate_hook",
           "get_balance_profile", "generate_megatron_gate_hook", "add_balance_log", "patch_forward_step",
           "patch_model_provider"]
