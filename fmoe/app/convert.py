"""`fmoe convert SRC DST --to fmoe|megatron|hf`: MoE checkpoints between fmoe's, Megatron-Core's and
HuggingFace's layouts.

- **fmoe**: a `torch.distributed.checkpoint` folder from `fmoe.distributed.checkpoint.save_checkpoint`
  or `fmoe.distributed.fsdp.save_checkpoint` (plain or FSDP2 runs, any expert-parallel size): every
  expert stored by global id, `model/<layer>.experts.w1_eDF@expert<g>` ([D, F]; w2 [F, D], b1, b2).
- **megatron**: Megatron-Core's own MoE layout in its per-rank torch checkpoint
  (`iter_0000000/mp_rank_00[_<ep rank>]/model_optim_rng.pt`, `{"model": state_dict}`): an fmoe layer
  `<X>.moe` becomes Megatron's MoE layer `<X>`, its experts
  `<X>.experts.local_experts.<i>.linear_fc1.weight` ([F, D]; `linear_fc2` [D, F]; `--expert-layout
  grouped`: `<X>.experts.linear_fc1.weight<i>`), numbered per expert-parallel rank (`--ep-size`), and
  its gate's projection `<X>.router.weight` / `.bias` (other gate tensors: `<X>.router.fmoe_gate.*`).
  Pipeline-sharded (`--pp-size`): `mp_rank_00_<pp rank>[_<ep rank>]`, each stage its share of the
  `decoder.layers.<i>` numbered from 0 as Megatron-Core numbers them, the embedding on the first
  stage, the final norm and output layer on the last. Read back, a folder with one suffix is a
  pipeline stage when it holds all its layers' experts, an expert-parallel rank otherwise.
- **hf**: a transformers MoE model's own folder (config.json, *.safetensors) in its family's layout.
  Read: `from_pretrained`, `fmoe.integrations.hf.convert`, the fmoe checkpoint state (every tensor
  must load). Written: the HF config's model built on the meta device, converted, filled from the
  checkpoint and `fmoe.integrations.hf.export`ed, so both directions use fmoe.integrations.hf's one
  mapping. The HF config comes from `--hf-config` (a folder with config.json, e.g. the original
  model's) or the config.json that SRC carries: converting from HF writes it into DST, fmoe and
  Megatron layouts alike.

Every other model tensor keeps its name. Optimizer states are not converted (the count is reported).
The expert tensors read and written are counted and must agree; a layer missing an expert's tensor
is an error, never a silent drop.

SRC is checked before anything is written: a `fmoe train` step folder against its manifest's SHA-256
checksums (the check `--resume` makes), every DCP shard against the sizes its `.metadata` records,
every safetensors file's header, and a Megatron checkpoint's rank folders by their names (its router
says how many experts a layer has, so a missing rank folder is named, never a smaller model) and its
rank files' zip records by their CRC-32s. DST is
written into a staging folder beside it and renamed into place once whole: an existing non-empty DST
is refused unless `overwrite` (then it is replaced whole), and any failure leaves DST as it was.

This module is the command: it picks the layouts and stages DST. The layouts are
`fmoe.app.layouts` (the checkpoint in no layout, fmoe's and HF's) and `fmoe.app.megatron_layout`;
their names are importable from here too.
"""
import argparse
import contextlib
import errno
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from torch.distributed.checkpoint.api import CheckpointException

from fmoe.app import checkpoints
from fmoe.app.files import UMASK, WriteError, fault, fsync_dir
from fmoe.app.layouts import (FMOE_EXPERT, HF_CONFIG, USER_EXPERT, MoECheckpoint, add_tensors,  # noqa: F401
                              check_safetensors, check_shard_sizes, load_hf_config, read_fmoe, read_hf,
                              save_hf_config, single_process, write_fmoe, write_hf)
from fmoe.app.megatron_layout import (DECODER_LAYER, FROM_MEGATRON, GROUPED, LAST_STAGE, LATEST,  # noqa: F401
                                      LAYOUTS, MEGATRON_FILE, MEGATRON_RANK, ROUTER_EXPERT_DIM, SEQUENTIAL,
                                      TO_MEGATRON, check_megatron_experts, check_ranks_complete,
                                      holds_all_experts, megatron_iteration_folder, megatron_layer,
                                      megatron_local_experts, megatron_rank_folders, pipeline_stages,
                                      read_megatron, renumber, write_megatron)

FORMATS = ("fmoe", "megatron", "hf")


def read(path: str) -> MoECheckpoint:
    if any(os.path.isfile(os.path.join(path, name)) for name in (checkpoints.MANIFEST, checkpoints.TRAINER_FILE)):
        checkpoints.verify_folder(Path(path))       # a `fmoe train` step folder: every file against its checksum
    if os.path.isfile(os.path.join(path, ".metadata")):
        ckpt = read_fmoe(path)
    elif os.path.isfile(os.path.join(path, LATEST)):
        ckpt = read_megatron(path)
    elif os.path.isfile(os.path.join(path, HF_CONFIG)):
        return read_hf(path)
    else:
        raise ValueError(f"SRC {path!r} is neither an fmoe checkpoint (a folder with .metadata), a Megatron one "
                         f"(a folder with {LATEST}) nor an HF model (a folder with {HF_CONFIG})")
    if os.path.isfile(os.path.join(path, HF_CONFIG)):
        ckpt.hf_config = load_hf_config(path)
    return ckpt


def convert(src: str, dst: str, to: str, ep_size: int = 1, layout: str = "sequential",
            hf_config: Optional[str] = None, overwrite: bool = False, pp_size: int = 1) -> dict:
    """Convert `src` into `dst` in the `to` layout (`hf_config`: a folder with the model's HF
    config.json, which `--to hf` needs unless SRC carries one); returns what was counted.
    SRC is read and checked whole, then DST written beside it and renamed into place: a non-empty
    DST is refused unless `overwrite` (which replaces it whole), and on any error DST is unchanged."""
    if to not in FORMATS:
        raise ValueError(f"--to must be one of {FORMATS}, got {to!r}")
    megatron_only = {"--ep-size": (ep_size, 1), "--pp-size": (pp_size, 1), "--expert-layout": (layout, "sequential")}
    for name, (value, default) in megatron_only.items():
        if to != "megatron" and value != default:
            raise ValueError(f"{name} {value} lays out Megatron checkpoints only (--to megatron), not --to {to}: "
                             "drop it")
    if hf_config is not None and not os.path.isdir(hf_config):
        raise ValueError(f"--hf-config {hf_config}: no such folder")
    if hf_config is not None and not os.path.isfile(os.path.join(hf_config, HF_CONFIG)):
        raise ValueError(f"--hf-config {hf_config}: the folder holds no {HF_CONFIG}")
    check_destination(src, dst, overwrite)
    config = None if hf_config is None else load_hf_config(hf_config)     # the arguments before SRC
    ckpt = read(src)
    if config is not None:
        ckpt.hf_config = config
    count_in = ckpt.check_whole(src)
    writers = {"megatron": lambda path: write_megatron(ckpt, path, ep_size, layout, pp_size),
               "fmoe": lambda path: write_fmoe(ckpt, path), "hf": lambda path: write_hf(ckpt, path)}
    with staging_folder(dst) as staging:
        written = writers[to](staging)
        count_out = read(staging).check_whole(dst)
        if not written == count_out == count_in:
            raise ValueError(f"read {count_in} expert tensors from {src}, wrote {written}, {dst} would hold "
                             f"{count_out}: nothing may be dropped")
        move_into_place(staging, dst)
    return {"expert_tensors": count_in, "layers": len(ckpt.experts), "dense_tensors": len(ckpt.dense),
            "not_converted": ckpt.skipped}


def check_destination(src: str, dst: str, overwrite: bool):
    src_path, dst_path = Path(src).resolve(), Path(dst).resolve()
    if src_path == dst_path:
        raise ValueError("SRC and DST must differ")
    if dst_path in src_path.parents:
        raise ValueError(f"SRC {src!r} is inside DST {dst!r}: DST is replaced whole, choose another DST")
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise ValueError(f"DST {dst!r} exists and is not a folder")
    if os.path.isdir(dst) and os.listdir(dst) and not overwrite:
        raise ValueError(f"DST {dst!r} is a non-empty folder: pass --overwrite to replace it whole, or choose a "
                         "new DST")


def errno_under(err: BaseException) -> Optional[int]:
    """The errno of the OSError behind a writer's error (ENOSPC first): torch's zip writer keeps it as the
    context, torch.distributed.checkpoint among its failures, safetensors only as '(os error N)'."""
    found, todo, seen = [], [err], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            found.append(e.errno)
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code:
            found.append(int(code[1]))
        todo += [e.__cause__, e.__context__, *(f[0] for f in getattr(e, "failures", {}).values())]
    return errno.ENOSPC if errno.ENOSPC in found else next(iter(found), None)


@contextlib.contextmanager
def staging_folder(dst: str):
    """A fresh folder beside `dst`, removed at the end whatever happened; a failed write is one line naming DST."""
    parent = os.path.dirname(os.path.abspath(dst))
    staging = None
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(dst))}.convert.", dir=parent)
        yield staging
    except (Exception, CheckpointException) as err:       # DCP's is a BaseException
        code = None if isinstance(err, ValueError) else errno_under(err)      # a ValueError says more itself
        if code is None:
            raise
        raise WriteError(code, f"could not write {dst}: {fault(code)}; {dst} is unchanged") from err
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def move_into_place(staging: str, dst: str):
    """Rename the whole `staging` folder to `dst`; an existing `dst` is moved aside first and removed after."""
    os.chmod(staging, 0o777 & ~UMASK)        # a plain mkdir's mode, not mkdtemp's 0700
    aside = f"{staging}.replaced"
    if os.path.lexists(dst):
        os.rename(dst, aside)
    try:
        os.rename(staging, dst)
    except OSError:
        if os.path.lexists(aside):
            os.rename(aside, dst)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(dst)))
    shutil.rmtree(aside, ignore_errors=True)


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("src", metavar="SRC", help="an fmoe, Megatron-Core or HF (config.json + safetensors) checkpoint "
                                               "folder")
    p.add_argument("dst", metavar="DST", help="the folder to write (a new or empty one, unless --overwrite)")
    p.add_argument("--to", required=True, choices=FORMATS, help="the layout to write")
    p.add_argument("--ep-size", type=int, default=1, help="Megatron: expert-parallel ranks to shard the experts over")
    p.add_argument("--pp-size", type=int, default=1,
                   help="Megatron: pipeline stages to split decoder.layers.<i> over (mp_rank_00_<pp rank>[_<ep rank>])")
    p.add_argument("--expert-layout", choices=LAYOUTS, default="sequential",
                   help="Megatron: SequentialMLP's local_experts.<i>.linear_fc1 or TEGroupedMLP's linear_fc1.weight<i>")
    p.add_argument("--hf-config", metavar="FOLDER", default=None,
                   help="hf: a folder with the model's HF config.json (the original model's), unless SRC carries one")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing non-empty DST whole (only once the new one is written and checked)")


def run(args):
    if args.to == "hf" or os.path.isfile(os.path.join(args.src, HF_CONFIG)):
        import transformers
        transformers.utils.logging.disable_progress_bar()      # the summary below says what was loaded
    counts = convert(args.src, args.dst, args.to, args.ep_size, args.expert_layout, args.hf_config, args.overwrite,
                     args.pp_size)
    print(f"{args.dst}: {counts['expert_tensors']} expert tensors in {counts['layers']} MoE layers (as many as read) "
          f"and {counts['dense_tensors']} other tensors; {counts['not_converted']} entries not converted "
          "(optimizer states, extras, buffers HF rebuilds)")
