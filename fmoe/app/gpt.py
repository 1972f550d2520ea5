"""A small byte-level GPT whose feed-forward blocks are `FMoETransformerMLP`: the model `fmoe train` trains."""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fmoe.experts import expert_shapes
from fmoe.layer import FMoE, collect_aux_loss
from fmoe.layer_checks import Tensors, check_fits, router_tensors
from fmoe.transformer import FMoETransformerMLP


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    num_expert: int = 8
    gate: str = "gshard"
    top_k: Optional[int] = None     # None: 1 for the switch gate (the only k it takes), else 2
    d_hidden: int = 256
    aux_coef: float = 0.01

    def __post_init__(self):
        if self.top_k is None:
            self.top_k = 1 if self.gate == "switch" else 2
        for name in ("vocab_size", "seq_len", "d_model", "n_layer", "n_head", "num_expert", "top_k", "d_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if (not isinstance(self.aux_coef, (int, float)) or isinstance(self.aux_coef, bool)
                or not math.isfinite(self.aux_coef) or self.aux_coef < 0):
            raise ValueError(f"aux_coef must be a finite number >= 0, got {self.aux_coef!r}")


# The fields that set the parameters' sizes.
SIZE_FIELDS = ("vocab_size", "seq_len", "d_model", "n_layer", "num_expert", "d_hidden")


def parameter_tensors(cfg: GPTConfig, ep_size: int = 1) -> Tensors:
    """The parameters `GPT(cfg, ep_size)` makes on one rank, as `fmoe.layer_checks` counts them,
    known without building it (the router: the one fmoe's gates build, [E, D] and a bias)."""
    D, L = cfg.d_model, cfg.n_layer
    experts = expert_shapes(cfg.num_expert // ep_size, D, cfg.d_hidden, gated=False, bias=True)
    return [("embeddings", (cfg.vocab_size, D), 1), ("embeddings", (cfg.seq_len, D), 1),
            ("layer norms", (D,), 4 * L + 2),
            ("attention", (3 * D, D), L), ("attention", (3 * D,), L), ("attention", (D, D), L), ("attention", (D,), L),
            *[("routers", shape, L) for _, shape, _ in router_tensors(cfg.gate, D, cfg.num_expert, bias=True)],
            *[("experts", shape, L) for shape in experts.values()]]


def size_names(cfg: GPTConfig, flags: dict) -> str:
    """The sizes as the user gave them: the options above their default, else every size option given,
    else the config's size fields."""
    given = [name for name in SIZE_FIELDS if name in flags]
    grown = [name for name in given if getattr(cfg, name) > getattr(GPTConfig, name)]
    if given:
        return ", ".join(f"{flags[name]} {getattr(cfg, name)}" for name in grown or given)
    return ", ".join(f"{name}={getattr(cfg, name)}" for name in SIZE_FIELDS)


def check_training_fits(cfg: GPTConfig, device: torch.device, ep_size: int = 1, flags: Optional[dict] = None):
    """A model whose training cannot fit on `device`, refused before anything is allocated: the
    parameters, their gradients and AdamW's two moments (4 x the parameters; activations come on top);
    the model is built on the CPU first, so off the CPU the parameters must fit there too. The message
    names the sizes by `flags` (GPTConfig field -> the option that gave it)."""
    named = size_names(cfg, flags or {})
    tensors = parameter_tensors(cfg, ep_size)
    check_fits(named, "training (the parameters, their gradients and AdamW's two moments) needs", tensors,
               device=device, copies=4)
    if device.type != "cpu":
        check_fits(named, "building the model on the CPU needs", tensors, device="cpu")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x_BTD):
        B, T, D = x_BTD.shape
        q, k, v = self.qkv(x_BTD).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    """Pre-norm: x + attn(ln(x)), then x + moe(ln(x))."""

    def __init__(self, cfg: GPTConfig, ep_size: int = 1, moe_group=None, fp8=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.moe = FMoETransformerMLP(num_expert=cfg.num_expert // ep_size, d_model=cfg.d_model,
                                      d_hidden=cfg.d_hidden, top_k=cfg.top_k, gate=cfg.gate, world_size=ep_size,
                                      moe_group=moe_group, fp8=fp8)

    def forward(self, x_BTD):
        x_BTD = x_BTD + self.attn(self.ln1(x_BTD))
        return x_BTD + self.moe(self.ln2(x_BTD))


class GPT(nn.Module):
    """`cfg.num_expert` experts per layer in all; with `ep_size` > 1 they are spread over the ranks
    of `moe_group` (torch.distributed must be initialised). `fp8`: the experts' GEMMs in that FP8 recipe
    (`fmoe.kernels.fp8`; None: off); it changes no parameter, so it is a run's choice, not the model's."""

    def __init__(self, cfg: GPTConfig, ep_size: int = 1, moe_group=None, fp8=None):
        super().__init__()
        if cfg.num_expert % ep_size:
            raise ValueError(f"num_expert ({cfg.num_expert}) must be divisible by the expert-parallel size {ep_size}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, ep_size, moe_group, fp8) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        init_dense_(self)

    def forward(self, idx_BT: torch.Tensor, targets: Optional[torch.Tensor] = None):
        """Logits [B, T, vocab] and, with `targets`, cross-entropy + aux_coef * the gates' balance losses."""
        if idx_BT.dim() != 2 or idx_BT.dtype != torch.long:
            raise ValueError(f"idx_BT must be a [batch, time] LongTensor, got {idx_BT.dtype} {tuple(idx_BT.shape)}")
        T = idx_BT.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len={self.cfg.seq_len}")
        pos_T = torch.arange(T, device=idx_BT.device)
        x_BTD = self.wte(idx_BT) + self.wpe(pos_T)
        for block in self.blocks:
            x_BTD = block(x_BTD)
        logits_BTV = self.lm_head(self.ln_f(x_BTD))
        if targets is None:
            return logits_BTV, None
        ce = F.cross_entropy(logits_BTV.float().flatten(0, 1), targets.flatten())
        return logits_BTV, ce + self.cfg.aux_coef * collect_aux_loss(self)

    def moe_layers(self):
        return [m for m in self.modules() if isinstance(m, FMoE)]

    def expert_loads(self) -> torch.Tensor:
        """Rows each expert received in the last forward, one row per MoE layer: [n_layer, num_expert]."""
        layers = self.moe_layers()
        if any(m.last_counts_E is None for m in layers):
            raise RuntimeError("expert_loads() needs a forward pass first")
        return torch.stack([m.last_counts_E for m in layers]).float()

    @torch.no_grad()
    def generate(self, idx_BT: torch.Tensor, max_new_tokens: int, temperature: float = 0.8, top_k: int = 10,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Append `max_new_tokens` sampled bytes (top-k sampling; temperature 0 is greedy)."""
        for _ in range(max_new_tokens):
            logits_BV = self(idx_BT[:, -self.cfg.seq_len:])[0][:, -1].float()
            if temperature == 0:
                next_B1 = logits_BV.argmax(-1, keepdim=True)
            else:
                top_logits, top_idx = torch.topk(logits_BV / temperature, min(top_k, logits_BV.shape[-1]))
                probs = torch.softmax(top_logits, -1)
                choice = torch.multinomial(probs.cpu(), 1, generator=generator).to(top_idx.device)
                next_B1 = top_idx.gather(-1, choice)
            idx_BT = torch.cat([idx_BT, next_B1], dim=1)
        return idx_BT


def init_dense_(model: GPT):
    """GPT-2 init for the dense parts; the experts and routers keep their own init."""
    inside_moe = {m for moe in model.moe_layers() for m in moe.modules()}
    for module in model.modules():
        if module in inside_moe:
            continue
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
