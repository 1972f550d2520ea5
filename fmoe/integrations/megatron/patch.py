"""FastMoE path `fmoe.megatron.patch`: wrapping Megatron's model provider and forward step."""
from fmoe.integrations.megatron.fmoefy import fmoefy
from fmoe.integrations.megatron.utils import megatron_args


def patch_model_provider(model_provider, gate=None, Megatron_Version=None, fmoe_num_experts=None, top_k=None,
                         hidden_hidden_size=None):
    """A model provider that builds the model and fmoefies it (fmoe's Megatron-Core `fmoefy`).

    FastMoE read the experts per rank and top-k from Megatron-LM's global arguments
    (`--fmoe-num-experts`, `--top-k`); they are used when present, else pass them here.
    As in FastMoE, the expert hidden size defaults to 4 * hidden / top_k / tensor-parallel size.
    """
    def fmoefied_model_provider(*args, **kwargs):
        model = model_provider(*args, **kwargs)
        margs = megatron_args()
        num = fmoe_num_experts if fmoe_num_experts is not None else getattr(margs, "fmoe_num_experts", None)
        k = top_k if top_k is not None else getattr(margs, "top_k", 2)
        if num is None:
            raise ValueError("patch_model_provider needs fmoe_num_experts= (experts per rank): Megatron-Core "
                             "has no global --fmoe-num-experts argument")
        hhs = hidden_hidden_size
        if hhs is None:
            config = model.config
            hhs = 4 * config.hidden_size // k // config.tensor_model_parallel_size
        return fmoefy(model, fmoe_num_experts=num, hidden_hidden_size=hhs, top_k=k, gate=gate or "naive")

    return fmoefied_model_provider


def patch_forward_step(forward_step_func, Megatron_Version=None):
    """FastMoE's Megatron-LM loss patch: raises `NotImplementedError`, as `MegatronMLP` adds the balance
    loss itself on Megatron-Core (elsewhere add `fmoe.collect_aux_loss(model)` to the loss)."""
    raise NotImplementedError(
        "patch_forward_step added the gates' balance loss to Megatron-LM's loss; on Megatron-Core, fmoe's "
        "MegatronMLP adds it itself (aux_loss_coeff, through Megatron's MoEAuxLossAutoScaler), so use "
        "forward_step_func unpatched; elsewhere add fmoe.collect_aux_loss(model) to the loss")

