"""Dynamic shadowing of hot experts (FasterMoE), parameter-server style.

The owner rank of an expert is its server. When the policy judges experts hot, every rank
*pulls* their parameters (a broadcast from the owner), computes its own rows for them at home,
and in the backward *pushes* the gradients back (a reduction to the owner), whose optimizer
then applies them as if the rows had travelled. Outputs and gradients equal the unshadowed layer.

Each owner sends its shadowed experts as one flat buffer (one collective per owner, not per
tensor). With `overlap` the pull is started before the token dispatch and waited for only when
the shadowed rows are computed, and the push is started as soon as the shadowed rows' backward
is done and waited for at the end of the layer's backward: the autograd engine runs ready nodes
newest first, so a node recorded before the dispatch runs after the rest of the layer's backward.
Blocking (`overlap=False`) sends the same buffers and waits at once: the numbers are identical.

Any expert module shadows: a module list (`ModuleListExperts`: expert i is `experts[i]`)
or stacked experts (every parameter [num_expert, ...], expert i its slice i, e.g. GroupedExperts
with any activation). A remote expert with local index i has the shapes of this rank's expert i.

About 400 lines in one module: the policy, the pull and the push are one protocol (what is pulled
is what is pushed back, through the same flat buffers), and read together.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from fmoe.distributed import timeout
from fmoe.distributed.groups import global_rank
from fmoe.distributed.link import start
from fmoe.env import env_flag
from fmoe.perf.perfmodel import PerfModel


def shadow_enabled_by_env() -> bool:
    return env_flag("FMOE_FASTER_SHADOW_ENABLE")


@dataclass
class ShadowPlan:
    experts_S: List[int]            # global ids of the shadowed experts, in the order rows are laid out
    counts_S: torch.Tensor          # this rank's rows for each of them

    @property
    def num_rows(self) -> int:
        return int(self.counts_S.sum()) if self.experts_S else 0


class ShadowPolicy:
    """Chooses the experts to shadow each step from every rank's per-expert counts (same on all ranks).

    One all-gather of the counts (they stay on their device); the model's choice is vectorised
    and only the chosen ids reach the host. `overlap=False` makes pulls and pushes blocking.
    """

    def __init__(self, model: PerfModel, overlap: bool = True):
        self.model = model
        self.overlap = overlap

    def gather_counts(self, counts_E: torch.Tensor, world_size: int, group=None) -> torch.Tensor:
        """counts_WE: rows each rank routes to each expert."""
        everyone = [torch.empty_like(counts_E) for _ in range(world_size)]
        dist.all_gather(everyone, counts_E.contiguous(), group=group)
        return torch.stack(everyone)

    def choose(self, counts_E: torch.Tensor, world_size: int, group=None) -> List[int]:
        return self.model.choose_shadowed(self.gather_counts(counts_E, world_size, group))


# ---- which tensors are expert i, and how to run experts with pulled ones ----

def expert_modules(experts: nn.Module, num_expert: int) -> Optional[nn.ModuleList]:
    """One module per expert, when the experts are such a list (FastMoE's `expert=` classes are a
    ModuleList themselves; other containers may hold one as `.experts`); else None."""
    for inner in (experts, getattr(experts, "experts", None)):
        if isinstance(inner, nn.ModuleList) and len(inner) == num_expert:
            return inner
    return None


def is_module_list(experts: nn.Module, num_expert: int) -> bool:
    return expert_modules(experts, num_expert) is not None


def check_shadowable(experts: nn.Module, num_expert: int):
    """Shadowing needs expert i's parameters: a module list of num_expert experts, or stacked parameters."""
    if is_module_list(experts, num_expert):
        return
    bad = [n for n, p in experts.named_parameters() if p.dim() == 0 or p.shape[0] != num_expert]
    if bad or not list(experts.parameters()):
        raise ValueError(
            f"shadow: the experts ({type(experts).__name__}) must be a module list of num_expert={num_expert} "
            f"experts (`.experts`) or have every parameter stacked [num_expert, ...]; not stacked: {bad}")


def expert_tensors(experts: nn.Module, num_expert: int, local: int) -> Dict[str, torch.Tensor]:
    """Expert `local`'s parameters on this rank, by name (slices of stacked parameters)."""
    if is_module_list(experts, num_expert):
        return dict(expert_modules(experts, num_expert)[local].named_parameters())
    return {n: p[local] for n, p in experts.named_parameters()}


def run_with(experts: nn.Module, num_expert: int, x_SD: torch.Tensor, counts_S: torch.Tensor,
             locals_S: List[int], tensors_S: List[Dict[str, torch.Tensor]],
             stacked: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
    """The experts' forward on rows grouped by shadowed expert, with the given (pulled) tensors;
    stacked experts may be handed their [S, ...] parameters ready made (`stacked`)."""
    if is_module_list(experts, num_expert):
        chunks = torch.split(x_SD, counts_S.tolist())
        modules = expert_modules(experts, num_expert)
        outs = [functional_call(modules[i], tensors, (chunk,))
                for i, tensors, chunk in zip(locals_S, tensors_S, chunks)]
        return torch.cat(outs)
    if stacked is None:
        stacked = {n: torch.stack([t[n] for t in tensors_S]) for n in tensors_S[0]}
    return functional_call(experts, stacked, (x_SD, counts_S))


# ---- buffers kept across steps ----

class BufferPool:
    """Flat buffers that shadowing reuses step after step: the pulled copies, their gradients and
    the pushed gradients an owner receives. glibc serves a block of 32 MiB or more (one expert at
    d_model 1024) with a fresh mmap, so on the CPU every fresh buffer page-faults on first touch,
    and that was most of what a shadowed expert cost here. On CUDA the caching allocator already
    reuses blocks, so there `take` allocates. A buffer is handed out again only when nothing else
    holds its storage (no saved tensor of a graph not yet run backward, no `.grad` view): a second
    forward before the first's backward gets fresh buffers. At most `per_tag` buffers per tag
    (`per_tag=0`: none kept, a fresh buffer every time)."""

    def __init__(self, per_tag: int = 2):
        self.per_tag = per_tag
        self.buffers: Dict[str, List[torch.Tensor]] = {}

    @staticmethod
    def _free(buf: torch.Tensor) -> bool:
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        if use_count is None:           # a torch without it: never reuse (always safe)
            return False
        # The pool's own tensor and the temporary storage object of this call hold it: 2.
        return use_count(buf.untyped_storage()._cdata) <= 2

    def take(self, tag: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised flat tensor of `numel` elements of `like`'s dtype and device."""
        if like.device.type != "cpu":
            return like.new_empty(numel)
        kept = self.buffers.setdefault(tag, [])
        for i, buf in enumerate(kept):
            if buf.dtype == like.dtype and self._free(buf):
                if buf.numel() < numel:         # a larger set shadowed than before: replace it
                    kept[i] = buf = like.new_empty(numel)
                return buf[:numel].detach()
        buf = like.new_empty(numel)
        if len(kept) < self.per_tag:
            kept.append(buf)
        return buf[:numel].detach()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for kept in self.buffers.values() for b in kept)

    def clear(self):
        """Let go of every kept buffer (those in use stay alive with their users)."""
        self.buffers = {}


# ---- pull and push ----

class GradientPush:
    """Gradient buffers on their way to their owners (ranks of `group`), summed there.

    On gloo, whose reduce runs at about half the speed of its sends (measured here: 32 MiB in 37 ms
    against 17 ms), every other rank sends its buffer to the owner, which adds them to its own in
    rank order at `wait`; elsewhere (NCCL) one reduce per owner."""

    def __init__(self, grads: List[torch.Tensor], owners: List[int], group=None, pool: Optional[BufferPool] = None):
        """`pool`: where the owner's receive buffers come from (default: fresh ones)."""
        pool = BufferPool(per_tag=0) if pool is None else pool
        self.grads, self.owners, self.group = grads, owners, group
        self.received = []
        what = f"{timeout.current_layer()}: shadowed experts' gradient push"
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        # Its wait keeps an interleaved micro-batch's turn: the owner's autograd graph differs from the
        # others', so the wait (in `_PushDone`'s backward) comes at another place in each rank's backward.
        if dist.get_backend(group) != "gloo":
            self.pending = start([dist.reduce(g, dst=global_rank(group, o), group=group, async_op=True)
                                  for g, o in zip(grads, owners)], what, nbytes, hands_turn=False)
            return
        me, world = dist.get_rank(group), dist.get_world_size(group)
        works, sent = [], 0
        for g, o in zip(grads, owners):
            if o != me:
                works.append(dist.isend(g, dst=global_rank(group, o), group=group))
                sent += g.numel() * g.element_size()
                continue
            for r in range(world):
                if r != me:
                    self.received.append(pool.take(f"push:{o}:from:{r}", g.numel(), g).view_as(g))
                    works.append(dist.irecv(self.received[-1], src=global_rank(group, r), group=group))
        received = sum(g.numel() * g.element_size() for g in self.received)
        self.pending = start(works, what, max(sent, received), hands_turn=False)

    def wait(self):
        self.pending.wait()
        if self.received:
            mine = self.grads[self.owners.index(dist.get_rank(self.group))]
            for g in self.received:
                mine.add_(g)
            self.received = []


class _Link:
    """What the pull's two autograd nodes share: the owners, their buffers and works in flight."""

    def __init__(self, group, overlap: bool):
        self.group, self.overlap = group, overlap
        self.owners: List[int] = []
        self.buffers: List[torch.Tensor] = []
        self.pending = None                     # the pull's broadcasts in flight
        self.push: Optional[GradientPush] = None
        self.grads: List[torch.Tensor] = []
        self.owned_sizes: List[int] = []        # numel of each tensor this rank owns, in buffer order
        self.fold = False                       # the owner's pushed gradients go through _AddPushed
        self.chunk_sizes: List[List[int]] = []  # how each buffer splits into the pieces the experts use
        self.pool = BufferPool(per_tag=0)           # fresh buffers, unless the caller's pool is given

    def wait(self):
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        if self.push is not None:
            self.push.wait()
            self.push = None


class _PushDone(torch.autograd.Function):
    """Recorded before the dispatch, so its backward runs after the rest of the layer's: waits for
    the gradient reduction and hands the owner its experts' gradients."""

    @staticmethod
    def forward(ctx, link: _Link, *owned):
        ctx.link = link
        ctx.shapes = [t.shape for t in owned]
        ctx.owns = bool(link.owned_sizes) and not link.fold
        return owned[0].new_empty(0)

    @staticmethod
    def backward(ctx, _):
        link = ctx.link
        link.wait()
        if not ctx.owns:
            return (None, None)
        mine = link.grads[link.owners.index(dist.get_rank(link.group))]
        grads = [g.view(s) for g, s in zip(mine.split(link.owned_sizes), ctx.shapes)]
        return (None, *grads)


class _AddPushed(torch.autograd.Function):
    """Identity on the owner's stacked parameters, on their way into its own experts' forward; its
    backward adds the pushed gradients of its shadowed experts into slices of the gradients the
    experts' backward produced. (Returning them from _PushDone for slice views of the parameters
    instead would make autograd zero-fill and add a whole [num_expert, ...] tensor per parameter.)"""

    @staticmethod
    def forward(ctx, link: _Link, owned_slots, *params):
        ctx.link, ctx.owned_slots = link, owned_slots       # [(local expert, parameter index)], buffer order
        ctx.like = [(p.shape, p.dtype, p.device) for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        link = ctx.link
        link.wait()
        me = dist.get_rank(link.group)
        if me not in link.owners or not link.grads:
            raise RuntimeError("shadow: the pushed gradients were not reduced before the owner's experts' backward")
        grads = [g if g is None or not g.requires_grad else g.clone() for g in grads]
        pieces = link.grads[link.owners.index(me)].split(link.owned_sizes)
        for (local, index), piece in zip(ctx.owned_slots, pieces):
            if grads[index] is None:
                shape, dtype, device = ctx.like[index]
                grads[index] = torch.zeros(shape, dtype=dtype, device=device)
            grads[index][local].add_(piece.view(grads[index][local].shape))
        return (None, None, *grads)


class _PullDone(torch.autograd.Function):
    """Waits for the broadcasts and returns the pulled buffers in pieces (`link.chunk_sizes`); its
    backward gathers the pieces' gradients into one flat buffer per owner and starts the push."""

    @staticmethod
    def forward(ctx, link: _Link, token):
        ctx.link = link
        link.wait()
        # The outputs become autograd outputs of this node, whose ctx holds the link: were the link
        # still to hold them, link -> tensor -> node -> ctx -> link would be a cycle through C++
        # that Python's gc cannot break, and every step would keep its layer's parameters alive.
        buffers, link.buffers = tuple(link.buffers), []
        # detach: plain tensors on the buffers' memory, not views autograd would track.
        return tuple(piece.detach() for buf, sizes in zip(buffers, link.chunk_sizes) for piece in buf.split(sizes))

    @staticmethod
    def backward(ctx, *grads):
        link = ctx.link
        # Each flat gradient is fresh (or the pool's, free), used by no one else: the reduction may
        # work in it in place.
        link.grads, first = [], 0
        for owner, sizes in zip(link.owners, link.chunk_sizes):
            pieces = [g.reshape(-1) for g in grads[first:first + len(sizes)]]
            first += len(sizes)
            if torch.is_grad_enabled():         # a double backward records the cat: no out=
                link.grads.append(torch.cat(pieces))
            else:
                link.grads.append(torch.cat(pieces, out=link.pool.take(f"grad:{owner}", sum(sizes), pieces[0])))
        link.push = GradientPush(link.grads, link.owners, link.group, link.pool)
        if not link.overlap:
            link.wait()
        return None, grads[0].new_empty(0)


class ShadowPull:
    """The shadowed experts' parameters, pulled from their owners; differentiable back to them."""

    def __init__(self, experts: nn.Module, plan: ShadowPlan, num_expert: int, group=None, overlap: bool = True,
                 fold: bool = False, pool: Optional[BufferPool] = None):
        """`fold`: the caller runs this rank's own experts through `run_local`, so an owner of stacked
        experts receives its pushed gradients inside those experts' gradients (see _AddPushed).
        `pool`: the flat buffers come from it (the layer's, kept across steps); default: fresh ones."""
        self.experts, self.plan, self.num_expert = experts, plan, num_expert
        self.fold = fold and not is_module_list(experts, num_expert)
        self.owned_slots = []
        self.locals_S = [e % num_expert for e in plan.experts_S]
        owner_S = [e // num_expert for e in plan.experts_S]
        me = dist.get_rank(group)
        self.link = link = _Link(group, overlap)
        if pool is not None:
            link.pool = pool
        link.owners = sorted(set(owner_S))
        templates = [expert_tensors(experts, num_expert, i) for i in self.locals_S]
        self.names = list(templates[0]) if templates else []
        self.slots = [[s for s, o in enumerate(owner_S) if o == owner] for owner in link.owners]
        # An owner's buffer holds its shadowed experts' tensors in `layout` order. Stacked experts
        # go name by name (all slots' w1, then all slots' b1, ...), so each stacked [S, ...]
        # parameter the shadowed rows need is one view of the buffer; module lists slot by slot.
        self.layouts = [self._layout(slots) for slots in self.slots]
        self.module_list = is_module_list(experts, num_expert)
        # The pieces the experts use: a module list's tensors one by one; stacked experts' [S_o, ...]
        # slab of each parameter for the owner's S_o slots, which layout order keeps together.
        link.chunk_sizes = [[templates[s][n].numel() for s, n in layout] if self.module_list
                            else [len(slots) * templates[slots[0]][n].numel() for n in self.names]
                            for slots, layout in zip(self.slots, self.layouts)]
        param_index = {n: i for i, n in enumerate(self.names)}
        owned = []
        for owner, layout, sizes in zip(link.owners, self.layouts, link.chunk_sizes):
            buf = link.pool.take(f"pull:{owner}", sum(sizes), templates[0][self.names[0]])
            if owner == me:
                owned = [templates[s][n] for s, n in layout]
                link.owned_sizes = [v.numel() for v in owned]
                self.owned_slots = [(self.locals_S[s], param_index[n]) for s, n in layout]
                with torch.no_grad():
                    torch.cat([v.reshape(-1) for v in owned], out=buf)
            link.buffers.append(buf)
        self.templates = templates
        link.pending = start([dist.broadcast(b, src=global_rank(group, o), group=group, async_op=True)
                              for b, o in zip(link.buffers, link.owners)],
                             f"{timeout.current_layer()}: shadowed experts' parameter pull",
                             sum(b.numel() * b.element_size() for b in link.buffers))
        if not overlap:
            link.wait()
        link.fold = self.fold
        # Non-owners (and folding owners) pass one of their own parameters so the node (and so the
        # wait for the push) is recorded everywhere.
        pushed_here = [] if self.fold else owned
        self.token = _PushDone.apply(link, *(pushed_here or [next(experts.parameters())]))

    def run_local(self, x_RD: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
        """This rank's own experts on the rows sent to them (with `fold`, through _AddPushed)."""
        if not (self.fold and self.owned_slots):
            return self.experts(x_RD, counts_e)
        names, params = zip(*self.experts.named_parameters())
        passed = _AddPushed.apply(self.link, self.owned_slots, *params)
        return functional_call(self.experts, dict(zip(names, passed)), (x_RD, counts_e))

    def _layout(self, slots: List[int]) -> List[tuple]:
        if is_module_list(self.experts, self.num_expert):
            return [(s, n) for s in slots for n in expert_tensors(self.experts, self.num_expert, self.locals_S[s])]
        return [(s, n) for n in self.names for s in slots]

    def forward(self, x_SD: torch.Tensor) -> torch.Tensor:
        """This rank's rows for the shadowed experts, computed at home with the pulled parameters."""
        pieces = iter(_PullDone.apply(self.link, self.token))
        tensors_S: List[Dict[str, torch.Tensor]] = [{} for _ in self.locals_S]
        if self.module_list:
            for layout in self.layouts:
                for s, n in layout:
                    tensors_S[s][n] = next(pieces).view(self.templates[s][n].shape)
            return run_with(self.experts, self.num_expert, x_SD, self.plan.counts_S, self.locals_S, tensors_S)
        slabs = [{n: next(pieces).view(len(slots), *self.templates[slots[0]][n].shape) for n in self.names}
                 for slots in self.slots]
        if len(slabs) == 1:
            # One owner: its slabs are the stacked [S, ...] parameters, in slot order; no copy.
            return run_with(self.experts, self.num_expert, x_SD, self.plan.counts_S, self.locals_S, [], slabs[0])
        for slots, slab in zip(self.slots, slabs):
            for j, s in enumerate(slots):
                tensors_S[s] = {n: slab[n][j] for n in self.names}
        return run_with(self.experts, self.num_expert, x_SD, self.plan.counts_S, self.locals_S, tensors_S)


def make_shadow_policy(shadow, d_model: int, experts: nn.Module, num_expert: int,
                       world_size: int) -> Optional[ShadowPolicy]:
    """`shadow`: None (FMOE_FASTER_SHADOW_ENABLE decides), a bool, or a ShadowPolicy."""
    if shadow is not None and not isinstance(shadow, (bool, ShadowPolicy)):
        raise ValueError(f"shadow must be None, a bool or a ShadowPolicy, got {shadow!r}")
    enabled = shadow_enabled_by_env() if shadow is None else shadow is not False
    if not enabled or world_size == 1:
        return None
    check_shadowable(experts, num_expert)
    if isinstance(shadow, ShadowPolicy):
        return shadow
    # The model's alpha * H^2 per expert: two d_model x d_hidden matrices hold 2 * alpha * H^2 parameters.
    params_per_expert = sum(p.numel() for p in experts.parameters()) / num_expert
    d_hidden = max(1, round(params_per_expert / (2 * d_model)))
    return ShadowPolicy(PerfModel.from_env(d_model, d_hidden))
