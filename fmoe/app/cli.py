"""The `fmoe` command: one subcommand per main job.

A subcommand is one COMMANDS entry: its help line, a function that adds its arguments and a
function that runs it (or, for a job in its own module, `from_module`). Only the chosen
subcommand's arguments are built, so each command imports just what it needs and `fmoe info`
stays fast.
"""
import argparse
import importlib
import os
import sys


def add_train_args(p: argparse.ArgumentParser):
    from fmoe.app.gpt import GPTConfig
    from fmoe.app.runtime import TrainConfig
    from fmoe.gates import GATES

    model, run = GPTConfig(), TrainConfig()
    # The model options default to None (not given): a resumed run takes the checkpoint's values for
    # those, and refuses a given one that differs.
    g = p.add_argument_group("model (a resumed run: the checkpoint's)")
    g.add_argument("--d-model", type=int, help=f"model width (default: {model.d_model})")
    g.add_argument("--layers", type=int, help=f"transformer blocks (default: {model.n_layer})")
    g.add_argument("--heads", type=int, help=f"attention heads (default: {model.n_head})")
    g.add_argument("--seq-len", type=int, help=f"context in bytes (default: {model.seq_len})")
    g.add_argument("--num-expert", type=int, help=f"experts per MoE layer (default: {model.num_expert})")
    g.add_argument("--top-k", type=int, help="experts per token (default: 1 for switch, else 2)")
    g.add_argument("--gate", choices=sorted(GATES), help=f"router (default: {model.gate})")
    g.add_argument("--d-hidden", type=int, help=f"hidden width of each expert (default: {model.d_hidden})")
    g.add_argument("--aux-coef", type=float, help=f"weight of the gates' balance losses (default: {model.aux_coef})")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=run.steps,
                   help="optimizer steps in all, counting those before --resume (default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=run.batch_size, help="sequences per step (default: %(default)s)")
    g.add_argument("--lr", type=float, default=run.lr,
                   help="peak learning rate: linear warmup, then cosine decay (default: %(default)s)")
    g.add_argument("--data", default=None,
                   help="a text file, or a folder whose text files are read (binary files, those with a NUL byte in "
                        "their first 8 KiB, never are) (default: the Python stdlib)")
    g.add_argument("--out", default=run.out,
                   help="folder for checkpoint.pt, history.json, training.png, created and checked for writing "
                        "before training starts (default: %(default)s)")
    g.add_argument("--seed", type=int, default=run.seed,
                   help="seeds the init, the batches and the gates' noise (default: %(default)s)")
    g.add_argument("--device", default=run.device,
                   help="auto (CUDA when there is one), cpu, cuda or cuda:N (default: %(default)s)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --out (any process count wrote it) up to --steps")
    g.add_argument("--resume-from", default=None, metavar="PATH",
                   help="continue from this checkpoint.pt or checkpoint/step-* folder instead (e.g. the previous one)")
    g.add_argument("--save-every", type=int, default=run.save_every, metavar="N",
                   help="also save a checkpoint every N steps; 0: at the end and on SIGINT/SIGTERM (default: %(default)s)")
    g.add_argument("--keep", type=int, default=run.keep, metavar="N",
                   help="checkpoints kept: the newest and N - 1 before it (default: %(default)s)")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (the MoE layers trace whole)")
    g.add_argument("--fp8", choices=("blockwise", "rowwise", "mxfp8"), default=None,
                   help="the experts' GEMMs with FP8 operands in this recipe (docs/fp8.md); the weights, optimizer "
                        "and checkpoints stay as they are, so a run resumes with or without it (default: off)")
    g.add_argument("--keep-freed-memory", action="store_true",
                   help="CPU: glibc's malloc keeps freed blocks for the next step instead of mapping them afresh "
                        "(fewer page faults; the process keeps its peak memory; see fmoe.observe.cpu_memory)")
    g.add_argument("--hf-model", default=None, metavar="PATH",
                   help="fine-tune this local transformers MoE checkpoint (converted with "
                        "fmoe.integrations.hf.convert) on the byte corpus instead of the GPT, and export it to --out "
                        "at the end (no checkpoints)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--nproc", type=int, default=1,
                   help="processes on this machine, started through torchrun (GPUs with NCCL, else CPU with gloo)")
    g.add_argument("--ep-size", type=int, default=1,
                   help="expert-parallel size: experts spread over this many ranks; the rest is data parallel")
    g.add_argument("--overlap", action="store_true",
                   help="run each step's batch as two micro-batches of half of it, interleaved, so one's expert "
                        "exchanges travel while the other computes (fmoe.interleave_micro_batches)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("dashboards")
    g.add_argument("--log", default=None, metavar="BACKENDS",
                   help="where each step's losses and every MoE layer's routing statistics go: tensorboard, wandb, "
                        "both comma-separated, or none; under --out (default: tensorboard when installed)")


INTERRUPTED_FILE = "FMOE_INTERRUPTED_FILE"


def relaunch_with_torchrun(nproc: int) -> int:
    """`fmoe train --nproc N ...` on one machine: the same command on N ranks through torchrun.

    torchrun runs in its own session and is told SIGTERM when this process dies (it then stops its
    ranks, which save); SIGINT and SIGTERM sent here are forwarded to it once. The status is 130
    when a signal stopped the run, whether it came here or to a rank (torchrun itself says 1).
    """
    import signal
    import subprocess
    import tempfile

    from fmoe.app.runtime import end_with_parent

    # torchrun would read --nproc as an abbreviation of its own --nproc-per-node: leave it out.
    argv, skip = [], False
    for arg in sys.argv[1:]:
        if skip or arg.startswith("--nproc="):
            skip = False
            continue
        skip = arg == "--nproc"
        if not skip:
            argv.append(arg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "fmoe.app.cli", *argv]
    # A rank stopped by a signal empties this file: torchrun's own status for it is just 1.
    marker = tempfile.NamedTemporaryFile(prefix="fmoe-interrupted-", delete=False)
    marker.write(b"no")
    marker.close()
    env = {**os.environ, INTERRUPTED_FILE: marker.name}
    child = subprocess.Popen(cmd, start_new_session=True, preexec_fn=end_with_parent, env=env)
    received = []

    def forward(signum, frame):
        received.append(signum)
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        interrupted = os.path.getsize(marker.name) == 0
        os.unlink(marker.name)
    return 130 if received or interrupted else status


def check_train_args(args):
    """What argparse cannot see, checked before any process starts: finite floats, process and expert counts
    that fit together, and an --out folder that can be written."""
    import math

    from fmoe.app.gpt import GPTConfig

    for name in ("aux_coef", "lr"):
        value = getattr(args, name)
        if value is not None and (not math.isfinite(value) or value < 0 or (name == "lr" and value == 0)):
            raise ValueError(f"{flag(name)} must be a finite number {'>' if name == 'lr' else '>='} 0, "
                             f"got {value!r}")
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    if args.ep_size < 1:
        raise ValueError(f"--ep-size must be >= 1, got {args.ep_size}")
    if args.nproc > 1 and args.nproc % args.ep_size:
        raise ValueError(f"--ep-size ({args.ep_size}) must divide --nproc ({args.nproc})")
    from fmoe.app.runtime import launched_by_torchrun

    if args.nproc == 1 and args.ep_size > 1 and not launched_by_torchrun():
        raise ValueError(f"--ep-size {args.ep_size} needs several processes: add --nproc {args.ep_size} "
                         "(or a multiple of it)")
    # A resumed run takes its expert count from the checkpoint; an --hf-model run from the model.
    num_expert = model_options(args).get("num_expert", GPTConfig.num_expert)
    if args.hf_model is None and not (args.resume or args.resume_from) and num_expert % args.ep_size:
        raise ValueError(f"--num-expert {num_expert} (experts per MoE layer in all) must be a multiple of "
                         f"--ep-size {args.ep_size}, which spreads them evenly over its ranks")
    from fmoe.app.files import check_writable_folder

    check_writable_folder(args.out, "--out")


# The GPT's options: argparse's name -> GPTConfig's.
MODEL_OPTIONS = {"seq_len": "seq_len", "d_model": "d_model", "layers": "n_layer", "heads": "n_head",
                 "num_expert": "num_expert", "top_k": "top_k", "gate": "gate", "d_hidden": "d_hidden",
                 "aux_coef": "aux_coef"}


def model_options(args) -> dict:
    """The GPTConfig fields given on the command line, with their values."""
    return {field: getattr(args, name) for name, field in MODEL_OPTIONS.items() if getattr(args, name) is not None}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# The GPT's options, which an --hf-model run (its model from the checkpoint, no checkpoints of its own) refuses.
NOT_HF_OPTIONS = ("d_model", "layers", "heads", "num_expert", "top_k", "gate", "d_hidden", "aux_coef", "compile", "fp8",
                  "resume", "resume_from", "save_every", "keep")


def check_hf_args(args, parser_defaults: dict):
    if args.resume or args.resume_from:
        raise ValueError("--resume does not apply with --hf-model: such runs save no checkpoint, only the exported "
                         "model at the end (fine-tune that further with --hf-model OUT)")
    given = [name for name in NOT_HF_OPTIONS if getattr(args, name) != parser_defaults[name]]
    if given:
        raise ValueError(f"--hf-model takes its model from the checkpoint and saves only the exported model: "
                         f"{', '.join(map(flag, given))} do not apply")


def run_hf_train(args):
    from fmoe.app.gpt import GPTConfig
    from fmoe.app.runtime import TrainConfig, launched_by_torchrun
    from fmoe.integrations.hf.finetune import finetune

    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed, device=args.device,
                      data=args.data, out=args.out, ep_size=args.ep_size, log=args.log)
    r = finetune(args.hf_model, cfg, seq_len=args.seq_len or GPTConfig.seq_len)
    if not launched_by_torchrun() or int(os.environ.get("RANK", "0")) == 0:
        print(f"done: step {r.step} in {r.seconds:.1f} s\nloss: {r.first_loss:.3f} (first step) -> "
              f"{r.last_loss:.3f} (mean of the last {r.last_window})\nexported: {r.exported} "
              f"(transformers' AutoModelForCausalLM.from_pretrained loads it)\nhistory:  {r.history}")
    if launched_by_torchrun():          # leave before gloo's teardown (see report_and_exit)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_train(args):
    from fmoe.app.gpt import GPTConfig, check_training_fits
    from fmoe.app.runtime import Interrupted, TrainConfig, launched_by_torchrun, resolve_device
    from fmoe.app.train import train

    check_train_args(args)
    if args.hf_model is not None:
        defaults = argparse.ArgumentParser()
        add_train_args(defaults)
        check_hf_args(args, vars(defaults.parse_args([])))
    # Built (and so checked) before the ranks start: a bad value is one line here, not one per rank.
    given = model_options(args)
    model_cfg = GPTConfig(**given)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed, device=args.device,
                      data=args.data, out=args.out, resume=args.resume, ep_size=args.ep_size,
                      save_every=args.save_every, keep=args.keep, resume_from=args.resume_from,
                      compile=args.compile, log=args.log, overlap=args.overlap, fp8=args.fp8,
                      model_flags={field: flag(name) for name, field in MODEL_OPTIONS.items() if field in given})
    if args.hf_model is None:       # sizes that cannot fit: one line here, not an allocation's traceback
        check_training_fits(model_cfg, resolve_device(args.device), args.ep_size, cfg.model_flags)
    if args.nproc != 1 and not launched_by_torchrun():
        return relaunch_with_torchrun(args.nproc)
    if args.keep_freed_memory:          # each rank, before the model's first allocation
        from fmoe.observe import cpu_memory
        cpu_memory.keep_freed_memory()
    if args.hf_model is not None:
        return run_hf_train(args)
    try:
        r = train(cfg, model_cfg, progress=not args.no_progress)
    except Interrupted:
        if launched_by_torchrun():      # saved; leave before gloo's teardown (see report_and_exit)
            if os.environ.get(INTERRUPTED_FILE):        # tell the launcher: torchrun reports only a failed rank
                open(os.environ[INTERRUPTED_FILE], "wb").close()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        raise
    if launched_by_torchrun():
        report_and_exit(r)
    print_report(r)


def report_and_exit(r):
    """A torchrun rank: rank 0 reports, then every rank leaves at once. torch's gloo can abort in
    its own teardown at interpreter exit after all the work is done, which torchrun would report
    as a failed run."""
    if int(os.environ.get("RANK", "0")) == 0:
        print_report(r)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def print_report(r):
    print(f"done: step {r.step} in {r.seconds:.1f} s, {r.tokens_per_s:,.0f} tokens/s while training")
    print(f"loss: {r.first_loss:.3f} (first step) -> {r.last_loss:.3f} (mean of the last {r.last_window}), "
          f"validation {r.val_loss:.3f}")
    print(f"expert load: max/mean {r.load_imbalance:.2f} averaged over layers (1.00 = balanced)")
    print(f"checkpoint: {r.checkpoint}\nhistory:    {r.history}\nplot:       {r.plot}")
    print(f"sample:\n{r.sample}")


def version_of(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def device_line() -> str:
    import torch

    if torch.cuda.is_available():
        names = []
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            names.append(f"cuda:{i} {prop.name} (sm_{prop.major}{prop.minor}, {prop.total_memory / 2**30:.0f} GiB)")
        return ", ".join(names)
    return f"CPU, {torch.get_num_threads()} threads"


def backend_lines():
    from fmoe.kernels import backend_report

    for name, value in backend_report().items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        yield f"{name}: {value}"


AOT_REPORT = "benchmarks/results/kernels-aot.json"


def add_info_args(p: argparse.ArgumentParser):
    p.add_argument("--aot", nargs="?", const=AOT_REPORT, default=None, metavar="PATH",
                   help="also print the AOT compile report of the Triton kernels (registers, spills, shared memory "
                        f"per GPU target; written by `python -m fmoe.tools.aot --out PATH`; default PATH: "
                        f"{AOT_REPORT})")


def aot_lines(path: str):
    import json

    if not os.path.isfile(path):
        raise ValueError(f"--aot: no report at {path}; write one with `python -m fmoe.tools.aot --out {path}`")
    with open(path) as f:
        doc = json.load(f)
    yield f"{path}: triton {doc['triton']}, {len(doc['rows'])} compiles, {len(doc['problems'])} problems"
    for where, s in doc["summary"].items():
        yield (f"{where:<15} at most {s['max_registers']} registers, {s['max_spill_stores']} bytes spilled, "
               f"{s['max_shared'] // 1024} KB shared memory (limit {s['shared_limit'] // 1024} KB)")
    for line in doc["problems"]:
        yield f"PROBLEM {line}"


def run_info(args):
    import platform

    import fmoe

    rows = [("fmoe", fmoe.__version__), ("python", f"{platform.python_version()} ({sys.executable})"),
            ("torch", version_of("torch")), ("triton", version_of("triton")), ("numpy", version_of("numpy")),
            ("platform", platform.platform()), ("device", device_line())]
    for name, value in rows:
        print(f"{name:<9} {value}")
    print("kernel backends:")
    for line in backend_lines():
        print(f"  {line}")
    if args.aot:
        print("Triton kernels compiled ahead of time:")
        for line in aot_lines(args.aot):
            print(f"  {line}")


def from_module(name: str):
    """(add_arguments, run) of a module that has both, imported only when its command is chosen."""
    return (lambda p: importlib.import_module(name).add_arguments(p),
            lambda args: importlib.import_module(name).run(args))


COMMANDS = {
    "train": ("train the byte-level MoE GPT (writes a checkpoint, history.json and training.png), "
              "or fine-tune a transformers MoE checkpoint with --hf-model",
              add_train_args, run_train),
    "bench": ("GFLOP/s and memory of one MoE layer beside its competitors", *from_module("fmoe.bench.run")),
    "simulate": ("FasterMoE's performance model over cluster sizes and load distributions",
                 *from_module("fmoe.perf.simulate")),
    "convert": ("MoE checkpoints between fmoe's, Megatron-Core's and HF's layouts, every expert counted",
                *from_module("fmoe.app.convert")),
    "info": ("versions, device and usable kernel backends (--aot: the kernels' AOT compile report)",
             add_info_args, run_info),
}


def build_parser(argv) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fmoe", description="Mixture-of-Experts for PyTorch: the main jobs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (help_text, add_arguments, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            add_arguments(p)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    run = COMMANDS[args.command][2]
    try:
        status = run(args)
    except (ValueError, FloatingPointError, OSError) as err:     # bad input, a diverged run, a failed write
        parser.exit(2, f"fmoe {args.command}: error: {err}\n")
    except KeyboardInterrupt:
        return 130
    return status if isinstance(status, int) else 0     # a run may return its exit status


if __name__ == "__main__":
    sys.exit(main())
