"""MegatronMLP: an fmoe MoE layer in the MLP slot of a Megatron-Core TransformerLayer."""
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, save_to_aux_losses_tracker
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
from torch import nn

from fmoe.gates.base import z_loss
from fmoe.gates.load_state import in_recompute
from fmoe.integrations.megatron.router import megatron_router_options
from fmoe.layer import FMoE


def require_parallel_state(who: str):
    if not parallel_state.model_parallel_is_initialized():
        raise ValueError(f"{who} needs Megatron's parallel state: call megatron.core.parallel_state."
                         "initialize_model_parallel(...) (or fmoe.integrations.megatron.training.initialize) first")


def activation_from_config(config: TransformerConfig):
    """fmoe's activation for Megatron's `activation_func` and `gated_linear_unit`."""
    act = config.activation_func
    if config.gated_linear_unit:
        if act is not F.silu:
            raise ValueError("fmoe's gated experts are SwiGLU: with gated_linear_unit=True, activation_func must be "
                             f"torch.nn.functional.silu, got {act!r}")
        return "swiglu"
    return {F.gelu: "gelu", F.relu: "relu"}.get(act, act)


class MegatronMLP(MegatronModule):
    """fmoe's MoE where Megatron-Core expects an MLP: `forward(hidden_states[s, b, h]) -> (output, None)`.

    Read from the TransformerConfig unless given: `num_experts` (all ranks together) from
    `num_moe_experts`, `top_k` from `moe_router_topk`, the expert width from `moe_ffn_hidden_size`
    or `ffn_hidden_size`, the activation from `activation_func` / `gated_linear_unit`, biases from
    `add_bias_linear`, `aux_loss_coeff` from `moe_aux_loss_coeff` (Megatron's default there is 0: no
    balance loss). The experts are spread over Megatron's expert-parallel group (`parallel_state`)
    and tagged `allreduce = False`, which is how Megatron's DDP and optimizer recognise expert
    parameters. The gate's balance loss times `aux_loss_coeff` reaches the training loss through
    Megatron's MoEAuxLossAutoScaler, as its own router's does. `gate="megatron"` routes as the
    config's TopKRouter would (`fmoe.integrations.megatron.router`: score function, pre-softmax, groups,
    scaling, expert bias, balance losses and their coefficients, z-loss). `shadow` (True or a ShadowPolicy)
    turns on FasterMoE's shadowing of hot experts over the expert-parallel group, as on FMoE;
    `recompute` chooses what the experts keep for backward, `exchange` / `ranks_per_node` how
    rows travel between the expert-parallel ranks, and `fp8` the experts' FP8 recipe (docs/fp8.md;
    fmoe's own, not Transformer Engine's `config.fp8`), as on FMoE.
    Built on the GPU when there is one.
    """

    def __init__(self, config: TransformerConfig, num_experts: Optional[int] = None, top_k: Optional[int] = None,
                 gate="naive", gate_kwargs: Optional[dict] = None, aux_loss_coeff: Optional[float] = None,
                 ffn_hidden_size: Optional[int] = None, backend: Optional[str] = None, shadow=None, pg_collection=None,
                 is_mtp_layer: bool = False, name: Optional[str] = None, recompute: str = "activation",
                 exchange: str = "slot", ranks_per_node: Optional[int] = None, fp8: Optional[str] = None):
        # pg_collection, is_mtp_layer and name are what megatron-core >= 0.17 passes every MLP builder.
        super().__init__(config=config)
        self.name = name
        self.is_mtp_layer = is_mtp_layer
        require_parallel_state("MegatronMLP")
        num_experts = num_experts if num_experts is not None else config.num_moe_experts
        if num_experts is None:
            raise ValueError("MegatronMLP needs the number of experts: set num_moe_experts in the TransformerConfig "
                             "or pass num_experts")
        self.ep_size = parallel_state.get_expert_model_parallel_world_size()
        if not isinstance(num_experts, int) or num_experts < 1 or num_experts % self.ep_size:
            raise ValueError(f"num_experts must be a positive multiple of the expert parallel size {self.ep_size}, "
                             f"got {num_experts!r}")
        if config.num_moe_experts is None:
            config.num_moe_experts = num_experts    # Megatron's schedules scale the balance loss of MoE configs only
        if config.expert_model_parallel_size != self.ep_size:
            raise ValueError(f"config.expert_model_parallel_size={config.expert_model_parallel_size} differs from "
                             f"Megatron's parallel state, whose expert parallel size is {self.ep_size}")
        if parallel_state.get_expert_tensor_parallel_world_size() != 1:
            raise ValueError("fmoe's experts are whole on each rank: initialise Megatron's parallel state with "
                             "expert_tensor_parallel_size=1")
        if gate == "megatron":
            options = megatron_router_options(config)
            gate, gate_kwargs = options["gate"], {**options["gate_kwargs"], **(gate_kwargs or {})}
            if aux_loss_coeff is None:
                aux_loss_coeff = options["aux_loss_coeff"]
        if aux_loss_coeff is None:
            aux_loss_coeff = config.moe_aux_loss_coeff
        if aux_loss_coeff < 0:
            raise ValueError(f"aux_loss_coeff must be >= 0, got {aux_loss_coeff!r}")
        self.aux_loss_coeff = aux_loss_coeff
        self.layer_number = None
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        ep_group = getattr(pg_collection, "ep", None) or parallel_state.get_expert_model_parallel_group()
        if ep_group.size() != self.ep_size:
            raise ValueError(f"pg_collection.ep has {ep_group.size()} ranks, Megatron's parallel state's expert "
                             f"parallel size is {self.ep_size}")
        ep_group = ep_group if self.ep_size > 1 else None
        use_cuda = torch.cuda.is_available()
        with torch.device(torch.cuda.current_device() if use_cuda else "cpu"):
            self.moe = FMoE(num_expert=num_experts // self.ep_size, d_model=config.hidden_size, world_size=self.ep_size,
                            moe_group=ep_group, top_k=top_k if top_k is not None else config.moe_router_topk,
                            gate=gate, gate_kwargs=gate_kwargs, gate_bias=config.add_bias_linear,
                            d_hidden=ffn_hidden_size or config.moe_ffn_hidden_size or config.ffn_hidden_size,
                            activation=activation_from_config(config), expert_bias=config.add_bias_linear,
                            backend=backend, shadow=shadow, recompute=recompute, exchange=exchange,
                            ranks_per_node=ranks_per_node, fp8=fp8)
        self.moe.to(dtype=config.params_dtype)
        self.moe.sequence_first = True      # Megatron's hidden states are [s, b, h]: aux_loss="sequence" reads them so
        if config.perform_initialization:
            self.init_like_megatron()
        if getattr(self.moe.gate, "balance_group", None) == "world":
            # The gate's replicas (whose loads a balancing bias or a global-batch loss sums) are the
            # ranks of this pipeline stage: its tensor x data x context parallel ranks.
            self.moe.gate.balance_group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        if self.tp_size > 1 and config.sequence_parallel:
            # Each tensor-parallel rank routes its part of the sequence: the losses count over all parts.
            self.moe.gate.token_partition = parallel_state.get_tensor_model_parallel_group()
        for p in self.moe.experts.parameters():
            p.allreduce = False
        for p in self.moe.gate.parameters():
            # With sequence parallelism each tensor-parallel rank routes its own tokens: Megatron sums these grads.
            p.sequence_parallel = config.sequence_parallel

    @torch.no_grad()
    def init_like_megatron(self):
        """Router projection and experts initialised as Megatron's own MoE: `init_method` for the inputs,
        `output_layer_init_method` for the expert outputs, zero biases; each expert-parallel rank's experts
        from its own RNG stream."""
        for module in self.moe.gate.modules():
            if isinstance(module, nn.Linear):
                self.config.init_method(module.weight)
                if module.bias is not None:
                    module.bias.zero_()
        with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            for name, p in self.moe.experts.named_parameters():
                if p.dim() == 2:
                    p.zero_()
                elif name.startswith("w1"):
                    self.config.init_method(p)
                else:
                    self.config.output_layer_init_method(p)

    def set_layer_number(self, layer_number: int):
        """Megatron's global layer number (1-based); the layer's name in a routing trace follows it, so each
        pipeline stage finds its own layers in a whole model's trace (`fmoe.replay_routing`)."""
        self.layer_number = layer_number
        if not self.is_mtp_layer:
            self.moe.routing_name = f"decoder.layers.{layer_number - 1}.mlp.moe"

    def forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """hidden_states [s, b, h]; `padding_mask` [b, s], True at padding (Megatron's convention): padded
        tokens are routed to no expert, output zeros and count in no balance loss."""
        if self.training and self.tp_size > 1 and not self.config.sequence_parallel:
            raise ValueError("MegatronMLP with tensor parallelism needs sequence_parallel=True in the "
                             "TransformerConfig, as Megatron's own MoE does")
        if padding_mask is None:
            output = self.moe(hidden_states)
            num_tokens = hidden_states.shape[0] * hidden_states.shape[1]
        else:
            keep_SB = self.real_tokens(hidden_states, padding_mask)
            output = torch.zeros_like(hidden_states).masked_scatter(keep_SB[..., None],
                                                                    self.moe(hidden_states[keep_SB]))
            num_tokens = keep_SB.sum()
        aux = self.moe.aux_loss
        if self.training and torch.is_grad_enabled() and self.aux_loss_coeff and aux is not None and aux.requires_grad:
            self.track_losses(aux.detach())
            scaled = self.aux_loss_coeff * aux
            if self.config.calculate_per_token_loss:
                # The main loss is then a sum over tokens, divided by the global token count later.
                scaled = scaled * num_tokens
            output = MoEAuxLossAutoScaler.apply(output, scaled)
        if self.training and self.config.moe_per_layer_logging and not in_recompute():
            self.track_routing_stats()
        return output, None

    def track_losses(self, aux: torch.Tensor):
        """This forward's gate losses in Megatron's MoE tracker: `z_loss` (the router z-loss, without its
        coefficient, as Megatron logs it) and `load_balancing_loss` (the balance losses, each times its
        coefficient). As Megatron's router logs them: the parts of a sequence-parallel partition add up,
        then the average over data-parallel ranks (and the pipeline stages' layers gathered)."""
        gate = self.moe.gate
        partition = parallel_state.get_tensor_and_context_parallel_group()
        balance = aux
        if getattr(gate, "z_loss_coef", 0.0) and gate.last_logits_TE is not None:
            z = z_loss(gate.last_logits_TE.detach(), gate.token_partition)
            save_to_aux_losses_tracker("z_loss", z, self.layer_number, self.config.num_layers, reduce_group=partition)
            balance = balance - gate.z_loss_coef * z
        save_to_aux_losses_tracker("load_balancing_loss", balance, self.layer_number, self.config.num_layers,
                                   reduce_group=partition)

    def track_routing_stats(self):
        """This forward's routing statistics, each a `routing_<statistic>` in Megatron-Core's tracker,
        where they add up over the micro-batches of a step on the device; logged, each rank's value
        is averaged over the data-parallel ranks. The slots routed to each expert e go in as
        `tokens_per_expert_<e>` (one tracker entry, so one all-reduce when logged, per expert),
        summed over a sequence-parallel partition's parts: logged, the tokens a micro-batch of one
        data-parallel rank sends each expert, averaged over the step's micro-batches and the
        data-parallel ranks."""
        partition = parallel_state.get_tensor_and_context_parallel_group()
        for e, count in enumerate(self.moe.routing_stats["tokens_per_expert"].float()):
            save_to_aux_losses_tracker(f"tokens_per_expert_{e}", count, self.layer_number, self.config.num_layers,
                                       reduce_group=partition)
        for key, value in self.moe.routing_stats.items():
            if key != "tokens_per_expert":
                # reduce_group_has_dp: megatron-core >= 0.19 would average over the same ranks again.
                save_to_aux_losses_tracker(f"routing_{key}", value.float(), self.layer_number, self.config.num_layers,
                                           avg_group=parallel_state.get_data_parallel_group(),
                                           reduce_group_has_dp=True)

    @staticmethod
    def real_tokens(hidden_states: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        """[s, b] True where a token is not padding."""
        if padding_mask.dim() != 2 or padding_mask.shape[::-1] != hidden_states.shape[:2]:
            raise ValueError(f"padding_mask must be [batch, seq] = {tuple(hidden_states.shape[1::-1])} for "
                             f"hidden_states [seq, batch, hidden] = {tuple(hidden_states.shape)}, "
                             f"got {tuple(padding_mask.shape)}")
        return ~padding_mask.transpose(0, 1).bool()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Experts stored by global expert id (axis 0 of the stacked weights, split over the
        expert-parallel ranks), so a checkpoint loads at any expert parallel size; the gate is
        replicated like any dense weight."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = self.moe.state_dict(prefix="", keep_vars=True)
        experts = {k: v for k, v in state.items() if k.startswith("experts.")}
        dense = {k: v for k, v in state.items() if k not in experts}
        sharded = make_sharded_tensors_for_checkpoint(
            dense, f"{prefix}moe.", sharded_offsets=sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(), dp_cp_group=metadata["dp_cp_group"])
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        replica_id = (0, 0, parallel_state.get_expert_data_parallel_rank())
        expert_axis = len(sharded_offsets)
        for name, tensor in experts.items():
            sharded[f"{prefix}moe.{name}"] = ShardedTensor.from_rank_offsets(
                f"{prefix}moe.{name}", tensor, *sharded_offsets, (expert_axis, ep_rank, self.ep_size),
                replica_id=replica_id, prepend_axis_num=len(sharded_offsets))
        return sharded
