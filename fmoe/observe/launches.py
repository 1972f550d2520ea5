"""Every kernel a layer's forward and backward would launch on a GPU, and the bytes each moves.

Counted on the CPU, so the GPU's launch list can be held in tests without a GPU:

- torch ops through a `TorchDispatchMode`: each op that runs a kernel (not a view, not an
  allocation) is one launch; it reads its tensor inputs and writes its outputs, whole. GEMMs
  (`mm`, `addmm`, `bmm`, `_grouped_mm`, ...) are told apart from the rest, the *glue*. The
  bodies of fmoe's own `fmoe::` ops are entered, so what they launch is counted, not the op.
- Triton kernels under Triton's interpreter (`TRITON_INTERPRET=1`): each grid launch is one
  launch, and its bytes are exact: the distinct addresses its loads read and its stores write
  (what a kernel must move at least; a GEMM re-reading a tile from L2 is not counted twice).

    table = count_launches(layer, x_TD, dy_TD)
    print(table.render())

`count_launches` also runs the router alone (the gate, the routing plan and the gate's backward)
and reports its launches apart, so the experts' share is the difference.
"""
import contextlib
import dataclasses
from typing import Dict, List, Optional

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "addbmm", "matmul", "linear", "_scaled_grouped_mm"}
# Ops that allocate or only describe memory: no kernel runs.
NO_KERNEL_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
                 "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "is_same_size", "set_",
                 "resize_", "_has_compatible_shallow_copy_type", "record_stream"}


@dataclasses.dataclass
class Launch:
    """One kernel launch: its name, kind ("triton", "gemm" or "glue"), and the bytes it reads and
    writes; `tensors` lists (shape, dtype) of what it touched, for the checks on fp32 temporaries."""
    name: str
    kind: str
    read: int = 0
    written: int = 0
    phase: str = "forward"
    tensors: list = dataclasses.field(default_factory=list)

    @property
    def bytes(self) -> int:
        return self.read + self.written


@dataclasses.dataclass
class LaunchTable:
    """A forward+backward's launches, the router's apart, per `tokens` tokens."""
    launches: List[Launch]
    router: List[Launch]
    tokens: int

    def layer_launches(self) -> List[Launch]:
        """The launches past the router's: each of the router's (matched by name, in order) taken out once."""
        left = [lau.name for lau in self.router]
        out = []
        for lau in self.launches:
            if lau.name in left:
                left.remove(lau.name)
            else:
                out.append(lau)
        return out

    def bytes_per_token(self, kind: Optional[str] = None, router: bool = False) -> float:
        rows = self.router if router else self.layer_launches()
        return sum(lau.bytes for lau in rows if kind is None or lau.kind == kind) / self.tokens

    def summary(self) -> dict:
        layer = self.layer_launches()
        return {
            "tokens": self.tokens,
            "launches": len(layer),
            "router_launches": len(self.router),
            "by_kind": {k: sum(1 for lau in layer if lau.kind == k) for k in ("triton", "gemm", "glue")},
            "bytes_per_token": {k: self.bytes_per_token(k) for k in ("triton", "gemm", "glue")},
            "kernels": [dataclasses.asdict(lau) | {"tensors": [list(map(str, t)) for t in lau.tensors]}
                        for lau in layer],
        }

    def render(self) -> str:
        lines = [f"{'phase':<9}{'kind':<7}{'kernel':<34}{'read B/token':>14}{'written B/token':>17}"]
        for lau in self.layer_launches():
            lines.append(f"{lau.phase:<9}{lau.kind:<7}{lau.name:<34}{lau.read / self.tokens:>14.1f}"
                         f"{lau.written / self.tokens:>17.1f}")
        layer = self.layer_launches()
        lines.append(f"{len(layer)} launches past the router's {len(self.router)}; bytes per token: "
                     + ", ".join(f"{k} {self.bytes_per_token(k):.1f}" for k in ("triton", "gemm", "glue")))
        return "\n".join(lines)


def _storage_key(t: torch.Tensor):
    return t.untyped_storage().data_ptr()


def _tensors(tree) -> List[torch.Tensor]:
    flat, _ = torch.utils._pytree.tree_flatten(tree)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _nbytes(ts: List[torch.Tensor]) -> int:
    """Bytes of the distinct tensors (by storage and view), each whole."""
    seen, total = set(), 0
    for t in ts:
        key = (_storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.launches: List[Launch] = []
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, name = func._schema.name.split("::")
        if namespace == "fmoe":
            from torch._library.custom_ops import OPDEFS
            with self:          # enter the op's body: what it launches is what counts
                return OPDEFS[func._schema.name]._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        in_storages = {_storage_key(t) for t in ins}
        views_only = outs and all(_storage_key(t) in in_storages for t in outs) and not func._schema.is_mutable
        if name in NO_KERNEL_OPS or views_only or (not outs and not func._schema.is_mutable):
            return out
        kind = "gemm" if name in GEMM_OPS else "glue"
        written = _nbytes(outs) if outs else _nbytes([t for t in ins if _is_written(func, args, t)])
        self.launches.append(Launch(f"aten::{name}", kind, _nbytes(ins), written, self.phase,
                                    [(tuple(t.shape), t.dtype) for t in ins + outs]))
        return out


def _is_written(func, args, t) -> bool:
    """For an in-place op with no tensor output: its first argument is what it writes."""
    return len(args) > 0 and args[0] is t


class _TritonBytes:
    """Distinct addresses each interpreted Triton launch loads and stores, while active."""

    def __init__(self, counter: _Counter):
        self.counter = counter
        self.loads: list = []
        self.stores: list = []

    @contextlib.contextmanager
    def active(self):
        from triton.runtime import interpreter
        builder = interpreter.interpreter_builder
        load, store, call = builder.create_masked_load, builder.create_masked_store, interpreter.GridExecutor.__call__
        tracker = self

        def masked_load(ptrs, mask, other, *rest):
            tracker.loads.append(_addresses(ptrs, mask))
            return load(ptrs, mask, other, *rest)

        def masked_store(ptrs, value, mask, *rest):
            tracker.stores.append(_addresses(ptrs, mask))
            return store(ptrs, value, mask, *rest)

        def grid_call(executor, *args, **kwargs):
            tracker.loads, tracker.stores = [], []
            # The interpreter's own copies to and from the host are not the kernel's launches.
            with torch.utils._python_dispatch._disable_current_modes():
                result = call(executor, *args, **kwargs)
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            tracker.counter.launches.append(Launch(
                f"triton:{executor.fn.__name__}", "triton", _distinct_bytes(tracker.loads),
                _distinct_bytes(tracker.stores), tracker.counter.phase,
                [(tuple(t.shape), t.dtype) for t in tensors]))
            return result

        builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
        interpreter.GridExecutor.__call__ = grid_call
        try:
            yield
        finally:
            builder.create_masked_load, builder.create_masked_store = load, store
            interpreter.GridExecutor.__call__ = call


def _addresses(ptrs, mask):
    """(addresses, bytes per element) of the elements a masked access touches."""
    size = ptrs.get_element_ty().primitive_bitwidth // 8
    addr = np.asarray(ptrs.data).reshape(-1)
    keep = np.broadcast_to(np.asarray(mask.data), np.asarray(ptrs.data).shape).reshape(-1)
    return addr[keep.astype(bool)], size


def _distinct_bytes(accesses) -> int:
    by_size: Dict[int, list] = {}
    for addr, size in accesses:
        by_size.setdefault(size, []).append(addr)
    return sum(size * np.unique(np.concatenate(chunks)).size for size, chunks in by_size.items())


@contextlib.contextmanager
def counting():
    """A context that records launches: yields the counter, whose `launches` fill in."""
    counter = _Counter()
    triton_bytes = _TritonBytes(counter) if _interpreting() else None
    with counter, (triton_bytes.active() if triton_bytes else contextlib.nullcontext()):
        yield counter


def _interpreting() -> bool:
    from fmoe.kernels.triton_grouped_mm import interpreting
    return interpreting()


def count_launches(layer, x: torch.Tensor, dy: torch.Tensor) -> LaunchTable:
    """The launches of one forward and backward of `layer` on x with output gradient dy and, for an
    FMoE layer, apart, of its router alone (gate, routing plan, the gate's backward)."""
    x = x.detach().requires_grad_(x.requires_grad)
    with counting() as counter:
        y = layer(x)
        counter.phase = "backward"
        torch.autograd.backward(y[0] if isinstance(y, tuple) else y, dy)
    router = _router_launches(layer, x.detach().reshape(-1, x.shape[-1])) if hasattr(layer, "dispatcher") else []
    layer.zero_grad(set_to_none=True)
    return LaunchTable(counter.launches, router, x.numel() // x.shape[-1])


def _router_launches(layer, x_TD: torch.Tensor) -> List[Launch]:
    x_rows = x_TD.requires_grad_(True)
    with counting() as router:
        routing = layer.route(x_rows, x_rows)
        layer.dispatcher.plan(routing)
    if routing.weight_TK.requires_grad:
        grad_TK = torch.ones_like(routing.weight_TK)
        with counting() as router_backward:
            router_backward.phase = "backward"
            torch.autograd.backward(routing.weight_TK, grad_TK)
        router.launches += router_backward.launches
        # Autograd adds the router's gradient of x to the experts' (one T x D add): the router's cost.
        size = x_TD.numel() * x_TD.element_size()
        router.launches.append(Launch("aten::add", "glue", 2 * size, size, "backward", [(tuple(x_TD.shape), x_TD.dtype)]))
    return router.launches
