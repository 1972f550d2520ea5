"""RouterGate: routing as composable options; each published MoE family is a named preset.

    logits = x W^T (+ b)                                   router projection, fp32 or higher
    scores = softmax(logits) | sigmoid(logits)
    choice = scores (+ e_score_correction_bias)            the bias steers the choice only
             limited to the best `topk_group` of `n_group` expert groups
    idx    = top-k(choice)                                 under fmoe.replay_routing: the recorded experts
    weight = scores[idx]  (renormalised if norm_topk_prob) * routed_scaling_factor

`softmax_after_topk` instead takes the top-k of the logits and weighs by a softmax over those
k (Mixtral as FastMoE's NaiveGate, gpt-oss, GraniteMoe); `sparsemixer` is PhiMoE's top-2.
"""
import math
import warnings

import torch

from fmoe.gates.balance_losses import (AUX_LOSSES, chosen_counts, global_loss, normalised_scores, sequence_loss,
                                       switch_loss)
from fmoe.gates.base import BaseGate, LinearRouter, check_bool, check_choice, check_float, check_int, slot_values
from fmoe.gates.load_state import BIAS_UPDATES, check_balance_group, in_recompute, reduce_over_replicas, trains

SELECTION_BIAS = (None, "frozen", "updated")
GROUP_SCORE = ("top2_sum", "max")


load_balancing_loss = switch_loss      # its earlier name: transformers' load_balancing_loss_func


class SparseMixerGrad(torch.autograd.Function):
    """PhiMoE's sparsemixer multiplier: forward `weight * midpoint`, backward the Heun
    third-order estimate of the routing gradient with respect to all logits."""

    @staticmethod
    def forward(ctx, logits_TE, weight_T1, chosen_T1, probs_TE, midpoint_T1):
        ctx.save_for_backward(weight_T1, chosen_T1, probs_TE)
        return weight_T1 * midpoint_T1

    @staticmethod
    def backward(ctx, grad_T1):
        weight_T1, chosen_T1, probs_TE = ctx.saved_tensors
        grad_T1 = grad_T1 * weight_T1
        grad_TE = (-grad_T1 * probs_TE).scatter_add(-1, chosen_T1, grad_T1)
        return grad_TE, None, None, None, None


def sparsemixer_top2(logits_TE: torch.Tensor, jitter_eps: float, training: bool, replayed_TK=None):
    """PhiMoE's top-2: each choice among the experts within a relative 2*eps of the best
    remaining logit (Gumbel-sampled in training, the best in evaluation); `replayed_TK` the two
    choices instead (each one's softmax over that band and the replayed expert)."""
    chosen, weights = [], []
    remaining_TE = logits_TE
    for i in range(2):
        with torch.no_grad():
            best_T1, best_idx_T1 = remaining_TE.max(dim=-1, keepdim=True)
            far_TE = (best_T1 - logits_TE) / logits_TE.abs().clamp(min=best_T1) > 2 * jitter_eps
            if replayed_TK is not None:
                best_idx_T1 = replayed_TK[:, i:i + 1].clamp_min(0)
                far_TE = far_TE.scatter(-1, best_idx_T1, False)
        masked_TE = remaining_TE.masked_fill(far_TE, -math.inf)
        if training and replayed_TK is None:
            gumbel_TE = torch.empty_like(masked_TE).exponential_().log()
            idx_T1 = (masked_TE - gumbel_TE).max(dim=-1)[1].unsqueeze(-1)
        else:
            idx_T1 = best_idx_T1
        probs_TE = torch.softmax(masked_TE, dim=-1)
        weight_T1 = probs_TE.gather(-1, idx_T1)
        if training:
            top_idx_T1 = probs_TE.max(dim=-1, keepdim=True)[1]
            keep_T1 = (idx_T1 == top_idx_T1) | (torch.rand_like(weight_T1) > 0.75)
            midpoint_T1 = torch.where(keep_T1, 1.0, 0.3333).to(probs_TE.dtype)     # PhiMoE's 1/3
            weight_T1 = SparseMixerGrad.apply(logits_TE, weight_T1, idx_T1, probs_TE, midpoint_T1)
        chosen.append(idx_T1)
        weights.append(weight_T1)
        remaining_TE = logits_TE.scatter(-1, idx_T1, -math.inf)
    return torch.cat(weights, dim=-1), torch.cat(chosen, dim=-1)


class RouterGate(BaseGate):
    """One gate core with composable routing options (see the module docstring).

    `selection_bias`: None, "frozen" (a loaded `e_score_correction_bias`, DeepSeek-V3) or
    "updated" (aux-loss-free balancing: the bias of an overloaded expert falls and an
    underloaded one rises by `bias_update_speed`, steered by the load summed over the gate's
    replicas, `balance_group`). `bias_update="step"` (the default) moves it once per optimizer
    step, from the load of all the step's training forwards (`fmoe.register_bias_update`);
    `"forward"` moves it at the start of each training forward from the load of the one
    before, for code without an optimizer hook. Neither moves it in a recompute, nor counts one.

    `max_nodes=M` is node-limited routing (DeepSeek-V3's): the groups are the nodes (the experts
    of `ranks_per_node` ranks each, default LOCAL_WORLD_SIZE, else all `world_size` ranks; FMoE
    passes its own), and each token's experts come from at most M of them, so the node exchange
    sends at most M rows of it across nodes. It sets n_group and topk_group, so takes neither.

    `aux_loss`: None, one of "switch", "sequence", "global", or several of them (a tuple), each
    times `aux_loss_coef` (a number, or a dict with one per loss); see `balance_losses`.
    "sequence" reads the sequences from the layer's input ([B, S, D], or [S, B, D] when the
    layer says `sequence_first`), or from `seq_len` tokens of a flat input. "global" counts the
    chosen experts over the replicas and over the step's micro-batches so far (the count
    restarts at each `register_bias_update` step; without that hook, at every forward).
    The last router logits stay in `last_logits_TE` (fp32 or higher).
    """

    keeps_fp32 = True
    reads_tokens_layout = True      # the layer sets tokens_layout before each forward (sequence losses read it)

    def __init__(self, d_model, num_expert, world_size=1, top_k=2, *, score="softmax", softmax_after_topk=False,
                 norm_topk_prob=False, routed_scaling_factor=1.0, n_group=1, topk_group=1, group_score="top2_sum",
                 gate_bias=False, selection_bias=None, bias_update_speed=1e-3, sparsemixer=False, jitter_eps=0.01,
                 aux_loss=None, aux_loss_coef=0.01, capacity=None, z_loss_coef=0.0, seq_len=None,
                 bias_update="step", balance_group="world", max_nodes=None, ranks_per_node=None):
        super().__init__(d_model, num_expert, world_size, top_k, capacity, z_loss_coef)
        if max_nodes is not None:
            n_group, topk_group = node_groups(max_nodes, world_size, ranks_per_node, n_group, topk_group)
        elif ranks_per_node is not None:
            raise ValueError("ranks_per_node lays the groups on the nodes only with max_nodes=: pass max_nodes too")
        self.max_nodes = max_nodes
        self.score = check_choice("score", score, ("softmax", "sigmoid"))
        self.softmax_after_topk = check_bool("softmax_after_topk", softmax_after_topk)
        self.norm_topk_prob = check_bool("norm_topk_prob", norm_topk_prob)
        self.routed_scaling_factor = check_float("routed_scaling_factor", routed_scaling_factor, low=0.0,
                                                 low_open=True)
        self.n_group = check_int("n_group", n_group)
        self.topk_group = check_int("topk_group", topk_group)
        self.group_score = check_choice("group_score", group_score, GROUP_SCORE)
        self.selection_bias = check_choice("selection_bias", selection_bias, SELECTION_BIAS)
        self.bias_update_speed = check_float("bias_update_speed", bias_update_speed)
        self.sparsemixer = check_bool("sparsemixer", sparsemixer)
        self.jitter_eps = check_float("jitter_eps", jitter_eps)
        self.aux_loss = aux_loss
        self.aux_loss_coef = aux_loss_coef
        self.aux_losses = check_aux_losses(aux_loss, aux_loss_coef)
        self.seq_len = None if seq_len is None else check_int("seq_len", seq_len)
        self.bias_update = check_choice("bias_update", bias_update, BIAS_UPDATES)
        self.balance_group = check_balance_group(balance_group)
        self.tokens_layout = None       # (leading dims, sequence_first) of the layer's input, set by the layer
        self.step_hooked = False        # set by fmoe.register_bias_update
        E = self.tot_expert
        if E % self.n_group:
            raise ValueError(f"n_group={n_group} must divide the number of experts ({E})")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={topk_group} must be at most n_group={n_group}")
        if self.top_k > self.topk_group * (E // self.n_group):
            raise ValueError(f"top_k={top_k} exceeds the {self.topk_group * (E // self.n_group)} experts in "
                             f"topk_group={topk_group} groups of {E // self.n_group}")
        if self.n_group > 1 and self.group_score == "top2_sum" and E // self.n_group < 2:
            raise ValueError("group_score='top2_sum' needs at least 2 experts per group")
        if self.sparsemixer and (self.top_k != 2 or self.score != "softmax" or self.softmax_after_topk
                                 or self.n_group > 1 or self.selection_bias is not None):
            raise ValueError("sparsemixer=True is PhiMoE's top-2 of softmax scores: it needs top_k=2 and no "
                             "softmax_after_topk, grouping or selection_bias")
        if self.softmax_after_topk and (self.norm_topk_prob or self.n_group > 1):
            raise ValueError("softmax_after_topk=True already sums the k weights to 1 and chooses by logits: "
                             "it takes neither norm_topk_prob nor group-limited top-k")
        self.gate = LinearRouter(d_model, E, bias=check_bool("gate_bias", gate_bias))
        if self.selection_bias is not None:
            self.register_buffer("e_score_correction_bias", torch.zeros(E))
        # Counts kept between optimizer steps, not checkpointed: a step's load, the global loss's slots.
        if self.selection_bias == "updated":
            self.register_buffer("step_load_E", torch.zeros(E, dtype=torch.long), persistent=False)
        if "global" in self.aux_losses:
            self.register_buffer("global_slots_E", torch.zeros(E, dtype=torch.long), persistent=False)
        self.global_fractions = []      # each forward's fraction_E, replayed by its recompute

    @classmethod
    def from_preset(cls, name: str, d_model, num_expert, world_size=1, top_k=None, **overrides) -> "RouterGate":
        """The router of a published family (`PRESETS`), with any option overridden."""
        if name not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
        options = dict(PRESETS[name])
        preset_top_k = options.pop("top_k")
        options.update(overrides)
        return cls(d_model, num_expert, world_size, preset_top_k if top_k is None else top_k, **options)

    def router_logits(self, x_TD):
        """The router projection; a gate with noise on its logits overrides this."""
        return self.gate(x_TD)

    def route(self, x_TD):
        logits_TE = self.router_logits(x_TD)
        counting = self.training and self.selection_bias == "updated" and trains()
        if counting and self.bias_update == "forward":
            end_step_of([self], self.balance_group, self.label, bias_only=True)
        expert_idx_TK, weight_TK = self.select(logits_TE, self.training)
        if counting:
            self.count_load(expert_idx_TK)
        return expert_idx_TK, weight_TK, weight_TK, logits_TE, self.balance_loss(logits_TE)

    def select(self, logits_TE, training: bool):
        """(expert_idx_TK, weight_TK) from the router logits: the selection and the weights of the
        module docstring (`training`: PhiMoE's sampled choice)."""
        if self.sparsemixer:
            weight_TK, expert_idx_TK = sparsemixer_top2(logits_TE, self.jitter_eps, training, self.replayed_TK)
        elif self.softmax_after_topk:
            top_TK, expert_idx_TK = self.choose(self.biased(logits_TE), self.top_k)
            if self.selection_bias is not None:
                top_TK = slot_values(logits_TE, expert_idx_TK, torch.finfo(logits_TE.dtype).min)
            weight_TK = torch.softmax(top_TK, dim=-1)
        else:
            scores_TE = torch.softmax(logits_TE, -1) if self.score == "softmax" else torch.sigmoid(logits_TE)
            choice_TE = self.limit_to_groups(self.biased(scores_TE.detach()))
            expert_idx_TK = self.choose(choice_TE, self.top_k)[1]
            weight_TK = slot_values(scores_TE, expert_idx_TK, 0.0)
            if self.norm_topk_prob:
                weight_TK = weight_TK / (weight_TK.sum(-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            weight_TK = weight_TK * self.routed_scaling_factor
        return expert_idx_TK, weight_TK

    def balance_loss(self, logits_TE):
        """The sum of the chosen `aux_loss` terms, each times its coefficient. Under replay each counts
        the replayed experts as the chosen ones."""
        aux = logits_TE.new_zeros(())
        chosen_TK = self.replayed_TK
        if "switch" in self.aux_losses:
            aux = aux + self.aux_losses["switch"] * switch_loss(logits_TE, self.top_k, self.token_partition,
                                                                chosen_TK)
        if "sequence" in self.aux_losses or "global" in self.aux_losses:
            scores_TE = normalised_scores(logits_TE, self.score)
            if "sequence" in self.aux_losses:
                chosen_SBK = None if chosen_TK is None else self.by_sequence(chosen_TK)
                aux = aux + self.aux_losses["sequence"] * sequence_loss(self.by_sequence(scores_TE), self.top_k,
                                                                        self.token_partition, chosen_SBK)
            if "global" in self.aux_losses:
                aux = aux + self.aux_losses["global"] * global_loss(
                    scores_TE, self.global_fraction(scores_TE, chosen_TK), self.token_partition)
        return aux

    def by_sequence(self, scores_TE):
        """The scores (or any per-token rows) laid [S, B, E]: B sequences of S tokens."""
        T, E = scores_TE.shape
        if self.seq_len is not None:
            if T % self.seq_len:
                raise ValueError(f"aux_loss='sequence': the {T} tokens are not whole sequences of seq_len={self.seq_len}")
            return scores_TE.view(T // self.seq_len, self.seq_len, E).transpose(0, 1)
        lead, sequence_first = self.tokens_layout if self.tokens_layout is not None else ((T,), False)
        if math.prod(lead) != T:
            raise ValueError(f"aux_loss='sequence': the gate routes {T} tokens of an input laid {tuple(lead)} "
                             "(sliced?): give the gate seq_len=")
        if len(lead) < 2:
            return scores_TE.view(T, 1, E)          # one sequence
        if sequence_first:
            return scores_TE.view(lead[0], -1, E)
        return scores_TE.view(-1, lead[-1], E).transpose(0, 1)

    def global_fraction(self, scores_TE, chosen_TK=None):
        """Slots on each expert / all slots, over the replicas and the step's micro-batches so far.
        A recompute replays its forward's fraction: the loss and its gradient come out the same."""
        slots_E = chosen_counts(scores_TE, self.top_k, chosen_TK)
        if not self.training:       # evaluation: this batch's own counts, no collective
            return slots_E.float() / slots_E.sum().clamp_min(1)
        if in_recompute() and self.global_fractions:
            return self.global_fractions.pop(0)
        slots_E = reduce_over_replicas(slots_E, self.balance_group, f"{self.label}: aux_loss='global'")
        if not self.step_hooked:
            self.global_slots_E.zero_()
            self.global_fractions.clear()
        self.global_slots_E += slots_E
        fraction_E = self.global_slots_E.float() / self.global_slots_E.sum().clamp_min(1)
        self.global_fractions.append(fraction_E)
        return fraction_E

    @property
    def label(self) -> str:
        return getattr(self, "layer_name", None) or type(self).__name__

    def biased(self, scores_TE):
        if self.selection_bias is None:
            return scores_TE
        return scores_TE + self.e_score_correction_bias.to(scores_TE.dtype)

    def limit_to_groups(self, choice_TE):
        """Only the experts of each token's best `topk_group` groups stay eligible."""
        if self.n_group == 1:
            return choice_TE
        T, E = choice_TE.shape
        grouped_TGe = choice_TE.view(T, self.n_group, E // self.n_group)
        if self.group_score == "max":
            group_TG = grouped_TGe.max(dim=-1).values
        else:
            group_TG = grouped_TGe.topk(2, dim=-1).values.sum(dim=-1)
        best_TG = torch.topk(group_TG, self.topk_group, dim=-1).indices
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter(1, best_TG, True)
        return grouped_TGe.masked_fill(~keep_TG.unsqueeze(-1), -math.inf).view(T, E)

    @torch.no_grad()
    def count_load(self, expert_idx_TK):
        """Adds this forward's chosen experts to the step's load, on the device (no collective)."""
        if self.bias_update == "step" and not self.step_hooked and not getattr(self, "warned_unhooked", False) \
                and not torch.compiler.is_compiling():      # Dynamo cannot trace a warning
            self.warned_unhooked = True
            warnings.warn(f"{self.label}: selection_bias='updated' moves the bias once per optimizer step: call "
                          "fmoe.register_bias_update(model, optimizer), or fmoe.end_step(model) after each step "
                          "(or pass bias_update='forward')", stacklevel=3)
        live_N = expert_idx_TK.reshape(-1)
        self.step_load_E.scatter_add_(0, live_N.clamp_min(0), (live_N >= 0).long())

    def end_step(self):
        """Moves the bias by the step's load summed over the replicas (one collective) and starts the
        next step; `fmoe.register_bias_update` does this for all gates at once."""
        end_step_of([self], self.balance_group, self.label)

    @torch.no_grad()
    def apply_load(self, load_E):
        """The aux-loss-free move: bias += speed * sign(mean load - load)."""
        bias_E = self.e_score_correction_bias
        load_E = load_E.float()
        bias_E += (self.bias_update_speed * torch.sign(load_E.mean() - load_E)).to(bias_E.dtype)


def node_groups(max_nodes, world_size: int, ranks_per_node, n_group, topk_group):
    """(n_group, topk_group) for `max_nodes`: one group per node, at most max_nodes of them a token."""
    from fmoe.distributed.exchange import ranks_per_node_of
    check_int("max_nodes", max_nodes)
    if (n_group, topk_group) != (1, 1):
        raise ValueError(f"max_nodes={max_nodes} lays the expert groups on the nodes (n_group = nodes, topk_group = "
                         f"max_nodes): pass it instead of n_group={n_group} / topk_group={topk_group}")
    nodes = world_size // ranks_per_node_of(world_size, ranks_per_node)
    if max_nodes > nodes:
        raise ValueError(f"max_nodes={max_nodes} exceeds the {nodes} nodes of world_size={world_size} "
                         f"(ranks_per_node={ranks_per_node_of(world_size, ranks_per_node)})")
    return nodes, max_nodes


def end_step_of(gates, group, what: str, bias_only: bool = False):
    """End an optimizer step for `gates` sharing one replica group: the loads of the updated biases
    summed over the replicas in one all-reduce, each bias moved, the step's counts reset."""
    updated = [g for g in gates if g.selection_bias == "updated"]
    if updated:
        loads = torch.cat([g.step_load_E for g in updated])
        summed = reduce_over_replicas(loads, group, f"{what}: the balancing bias's step update")
        for gate, load_E in zip(updated, summed.split([g.tot_expert for g in updated])):
            gate.apply_load(load_E)
            gate.step_load_E.zero_()
    if not bias_only:
        for gate in gates:
            gate.step_hooked = True         # someone ends the steps: the counts span them
            if "global" in gate.aux_losses:
                gate.global_slots_E.zero_()
                gate.global_fractions.clear()


def check_aux_losses(aux_loss, aux_loss_coef) -> dict:
    """{loss name: coefficient} from RouterGate's `aux_loss` and `aux_loss_coef` arguments."""
    if aux_loss is None:
        if not isinstance(aux_loss_coef, dict):
            check_float("aux_loss_coef", aux_loss_coef)
        return {}
    names = (aux_loss,) if isinstance(aux_loss, str) else aux_loss
    if not isinstance(names, (tuple, list)) or not names or any(n not in AUX_LOSSES for n in names) \
            or len(set(names)) != len(names):
        raise ValueError(f"aux_loss must be None, one of {list(AUX_LOSSES)} or a tuple of distinct ones, "
                         f"got {aux_loss!r}")
    if isinstance(aux_loss_coef, dict):
        if set(aux_loss_coef) != set(names):
            raise ValueError(f"aux_loss_coef as a dict must give one coefficient for each of {list(names)}, "
                             f"got {aux_loss_coef!r}")
        return {n: check_float(f"aux_loss_coef[{n!r}]", aux_loss_coef[n]) for n in names}
    coef = check_float("aux_loss_coef", aux_loss_coef)
    return {n: coef for n in names}


# Each family's router in transformers 5.24 (`modeling_<family>.py`), as RouterGate options.
# `top_k` is the family config's default; options read from a config (norm_topk_prob,
# routed_scaling_factor, n_group, topk_group, jitter) go in as overrides.
PRESETS = {
    "mixtral": dict(top_k=2, norm_topk_prob=True),
    "qwen2_moe": dict(top_k=4, norm_topk_prob=False),
    "qwen3_moe": dict(top_k=8, norm_topk_prob=False),
    "olmoe": dict(top_k=8, norm_topk_prob=False),
    "deepseek_v2": dict(top_k=6, norm_topk_prob=False, group_score="max"),
    "deepseek_v3": dict(top_k=8, score="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, n_group=8,
                        topk_group=4, group_score="top2_sum", selection_bias="frozen"),
    "gpt_oss": dict(top_k=4, softmax_after_topk=True, gate_bias=True),
    "granitemoe": dict(top_k=2, softmax_after_topk=True),
    "phimoe": dict(top_k=2, sparsemixer=True, jitter_eps=0.01),
    "dbrx": dict(top_k=1, norm_topk_prob=True),        # moe_normalize_expert_weights=1 (the default)
    "jamba": dict(top_k=2, norm_topk_prob=False),
}
"""Each HuggingFace family's router as `RouterGate` options, by family name; `RouterGate.from_preset`
builds one. `top_k` is the family's default; what a model config sets goes in as overrides."""
