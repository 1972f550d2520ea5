"""FP8 weights quantised once per optimiser step, kept until they change (#49).

A step quantises each expert weight once per orientation its GEMMs read (`fmoe.kernels.fp8`): the
forward reads w along its rows, the input gradient reads w^T. Blockwise 128 x 128 blocks are the same
blocks either way, so one quantised copy serves both; rowwise and MXFP8 keep a second one. Without a
cache every forward, every recompute and every backward of every micro-batch quantised the weights
again; with it, a step with M micro-batches and recompute quantises each weight once per orientation.

An entry is keyed by where the weight's data lives (autograd hands the backward and a recompute aliases
of the saved weight: the same storage and version counter). It is valid while the tensor that made it
lives, the data is where it was with the same shape, strides and version, and no optimiser has stepped
since. So it is dropped when:
- any `torch.optim.Optimizer` steps (a global post-step hook clears the whole cache, freeing it);
- the weight is written in place (`w.add_(...)`, `w.copy_(...)`, `load_state_dict`: the version moves);
- the weight's data is replaced (`w.data = t`: the storage moves) or the tensor that made it is freed.
A write through `w.data.copy_(...)` outside an optimiser step moves none of these (`.data` has its own
version counter): call `forget_quantised_weights()` after one, or set FMOE_FP8_WEIGHT_CACHE=0 to
quantise at every use (the results are the same; only the work differs).

The cache holds e4m3 data and scales: blockwise about half a bf16 weight's bytes, rowwise and MXFP8
about one (two orientations). It lives from a weight's first FP8 use to the next optimiser step.
"""
import os
import weakref
from typing import Dict, Optional, Tuple

import torch

from fmoe.kernels import fp8_quant as fp8

_entries: Dict[tuple, Tuple[weakref.ref, dict]] = {}
_counts = {"quantised": 0, "reused": 0}
_hook = None


def enabled() -> bool:
    """Whether quantised weights are kept between uses (FMOE_FP8_WEIGHT_CACHE, default on; 0 turns it off)."""
    return os.environ.get("FMOE_FP8_WEIGHT_CACHE", "1") != "0"


def forget_quantised_weights(*_args, **_kwargs) -> None:
    """Drop every cached quantised weight (every optimiser step does; call it after writing through `.data`)."""
    _entries.clear()


def counts() -> Dict[str, int]:
    """How many weight quantisations ran and how many uses found one cached, since `reset_counts()`."""
    return dict(_counts)


def reset_counts() -> None:
    _counts.update(quantised=0, reused=0)


def _install_step_hook() -> None:
    global _hook
    if _hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        _hook = register_optimizer_step_post_hook(forget_quantised_weights)


def _stamp(w: torch.Tensor, dtype: torch.dtype) -> tuple:
    """What must not have changed for a quantised copy of w (cast to dtype) to still be w's."""
    return (w._version, w.untyped_storage().nbytes(), w.storage_offset(), tuple(w.shape), w.stride(), w.dtype, dtype)


def _drop(ident, ref) -> None:
    """The tensor that made an entry is gone: so is the entry (unless a newer one took its place)."""
    found = _entries.get(ident)
    if found is not None and found[0] is ref:
        del _entries[ident]


def _transposed(q: fp8.Quantised) -> fp8.Quantised:
    return fp8.Quantised(q.data.transpose(-1, -2), q.scale.transpose(-1, -2), q.block[::-1])


def quantised_weight(w_eKO: torch.Tensor, recipe: str, transposed: bool = False,
                     dtype: Optional[torch.dtype] = None) -> fp8.Quantised:
    """w [..., K, O] (its transpose [..., O, K] with `transposed`) quantised as a GEMM's right operand
    reducing over its rows (`fmoe.kernels.fp8.quantise_weight`), from w cast to `dtype` (None: as it is);
    the same values as quantising it now, from the cache where this step already quantised it."""
    dtype = w_eKO.dtype if dtype is None else dtype
    # Blockwise blocks are square: w^T's quantisation is w's, transposed.
    shared = recipe == "blockwise"
    key = (recipe, False if shared else transposed, dtype)

    def make():
        _counts["quantised"] += 1
        source = w_eKO.to(dtype)
        return fp8.quantise_weight(source if shared or not transposed else source.transpose(-1, -2), recipe)

    if not enabled() or w_eKO.is_inference():      # inference tensors keep no version counter
        q = make()
    else:
        _install_step_hook()
        # Keyed by where the data lives, not by the tensor object: autograd hands a backward (and a
        # recompute) aliases of the weight it saved, which share its storage and version counter.
        ident = (w_eKO.device, w_eKO.data_ptr())
        found = _entries.get(ident)
        if found is None or found[0]() is None:
            found = (weakref.ref(w_eKO, lambda _ref, ident=ident: _drop(ident, _ref)), {})
            _entries[ident] = found
        per_key = found[1]
        stamp = _stamp(w_eKO, dtype)
        hit = per_key.get(key)
        if hit is not None and hit[0] == stamp:
            _counts["reused"] += 1
            q = hit[1]
        else:
            q = make()
            per_key[key] = (stamp, q)
    return _transposed(q) if shared and transposed else q
