"""`load`: a published MoE checkpoint converted to fmoe layers, each EP rank keeping only its experts.

transformers can only load a whole model, so under expert parallelism the ranks of the EP group
take turns: a rank loads the checkpoint, converts it (keeping its slice of every block's experts,
the rest freed at once), then hands over to the next. At any moment at most one rank of the group
holds all experts; the others hold their slice or nothing yet.
"""
import gc
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from fmoe.integrations.hf.convert import convert


def _read(path, dtype, model_class):
    import transformers
    model_class = model_class or transformers.AutoModelForCausalLM
    return model_class.from_pretrained(path, dtype=dtype)


def load(path, ep_size: int = 1, moe_group: Optional[dist.ProcessGroup] = None, dtype=torch.float32,
         model_class=None, **options):
    """`convert(from_pretrained(path), ep_size, moe_group, **options)`, loading in turns across the
    EP group (`moe_group`, or the world) so that no two of its ranks hold all experts at once.
    `path` is a local transformers checkpoint folder; `model_class` defaults to AutoModelForCausalLM.
    A collective under expert parallelism: every rank of the group must call it; each turn ends in a
    barrier bounded by the process group's timeout, which must exceed one rank's load."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"load: path must be a local transformers checkpoint folder with a config.json, "
                         f"got {str(path)!r}")
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"load: ep_size must be a positive int, got {ep_size!r}")
    if ep_size == 1:
        return convert(_read(folder, dtype, model_class), **options)
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"load: ep_size={ep_size} needs torch.distributed initialised (one process per EP rank)")
    group_size = dist.get_world_size(moe_group)
    if group_size != ep_size:
        raise ValueError(f"load: ep_size={ep_size} must equal the size of moe_group ({group_size})")
    rank = dist.get_rank(moe_group)
    model, error = None, None
    for turn in range(ep_size):
        if turn == rank:
            try:
                model = convert(_read(folder, dtype, model_class), ep_size=ep_size, moe_group=moe_group, **options)
            except Exception as err:            # the others must still reach every barrier
                error = err
            gc.collect()                        # the other ranks' experts go before the next turn
        dist.barrier(group=moe_group)
    failed = torch.tensor([error is not None], dtype=torch.int32)
    dist.all_reduce(failed, group=moe_group)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError("load: another rank of the EP group failed to load or convert the checkpoint "
                           "(its error names why)")
    return model
