"""`HFMoEBlock`: a transformers sparse MoE block run by fmoe, as `fmoe.integrations.hf.convert` builds it.

The block is an `FMoE` with a `RouterGate` set from the family's preset and config, the experts
(sliced to this rank's under expert parallelism), the shared experts, and `router`, a weightless
instance of the family's router class that passes the router logits through, so transformers'
output capturing (`output_router_logits`) finds them. gpt-oss's block returns (hidden_states,
router_scores): the converted one returns (hidden_states, None), which its decoder layer discards.
Input jitter in training (Mixtral, PhiMoE, DBRX) is applied once, to a copy: transformers
multiplies the hidden states in place (PhiMoE twice); it is random either way.
"""
import torch
from torch import nn

from fmoe.integrations.hf.families import BY_NAME
from fmoe.layer import FMoE


class LogitsRecorder(nn.Module):
    """Identity on the router logits; subclassed per family with the family's router class, whose
    instances transformers hooks to record `router_logits`.

    It holds no tensors of its own, but the family's router tensors are readable on it by the router's
    names (`weight`, `bias`, `e_score_correction_bias`): views of the fmoe gate's, so that transformers'
    initialisation (`post_init`, `init_weights`), which finds it by the router's class, initialises the
    gate's router as the family initialises its own. A name the family's router had as None stays None."""

    def __init__(self):
        nn.Module.__init__(self)
        object.__setattr__(self, "_router_views", {})

    def view_router(self, gate: nn.Module, views: dict):
        """Read each name of `views` as `gate`'s tensor under the state-dict key it maps to (or None)."""
        object.__setattr__(self, "_router_gate", gate)
        self._router_views.update(views)

    def __getattr__(self, name):
        views = self.__dict__.get("_router_views", {})
        if name in views:
            key = views[name]
            return None if key is None else self.__dict__["_router_gate"].state_dict(keep_vars=True)[key]
        return super().__getattr__(name)

    def forward(self, logits_TE):
        return logits_TE

    def extra_repr(self):
        return ""


_RECORDERS = {}


def recorder_for(router: nn.Module, gate: nn.Module = None, router_keys: dict = None) -> LogitsRecorder:
    """A LogitsRecorder that is an instance of `router`'s class and carries its forward hooks; with
    `gate` and `router_keys` (the router's tensor names to the gate's state-dict keys) the router's
    tensors read as the gate's."""
    cls = type(router)
    if cls not in _RECORDERS:
        _RECORDERS[cls] = type(f"FMoE{cls.__name__}Logits", (LogitsRecorder, cls), {})
    recorder = _RECORDERS[cls]()
    # transformers installs its capturing hooks once per model: ones already on the router move over.
    for hooks in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        getattr(recorder, hooks).update(getattr(router, hooks))
    if gate is not None:
        own = {name: None for name in list(router._parameters) + list(router._buffers)}
        own.update({name: key for name, key in (router_keys or {}).items() if name in own})
        recorder.view_router(gate, own)
    return recorder


class HFMoEBlock(nn.Module):
    """A transformers sparse MoE block run by fmoe (see the module docstring)."""

    def __init__(self, family: str, moe: FMoE, router: LogitsRecorder, input_jitter: float = 0.0):
        super().__init__()
        self.family = family
        self.moe = moe
        self.router = router
        self.input_jitter = float(input_jitter or 0.0)

    def forward(self, hidden_states, *args, **kwargs):
        if self.training and self.input_jitter > 0:
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.input_jitter, 1.0 + self.input_jitter)
            hidden_states = hidden_states * noise
        y = self.moe(hidden_states)
        self.router(self.moe.gate.last_logits_TE)
        return (y, None) if BY_NAME[self.family].returns_router_scores else y

    def extra_repr(self):
        return f"family={self.family!r}"


def converted_blocks(model: nn.Module):
    """(name, HFMoEBlock) of every converted block."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, HFMoEBlock)]
