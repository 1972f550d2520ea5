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
    instances transformers hooks to record `router_logits`."""

    def __init__(self):
        nn.Module.__init__(self)

    def forward(self, logits_TE):
        return logits_TE

    def extra_repr(self):
        return ""


_RECORDERS = {}


def recorder_for(router: nn.Module) -> LogitsRecorder:
    """A LogitsRecorder that is an instance of `router`'s class and carries its forward hooks."""
    cls = type(router)
    if cls not in _RECORDERS:
        _RECORDERS[cls] = type(f"FMoE{cls.__name__}Logits", (LogitsRecorder, cls), {})
    recorder = _RECORDERS[cls]()
    # transformers installs its capturing hooks once per model: ones already on the router move over.
    for hooks in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        getattr(recorder, hooks).update(getattr(router, hooks))
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
