"""Faults injected into `fmoe train` and its file writes: full disks, kills, signals at every phase of a
step, corrupt / truncated / empty / foreign checkpoints, invalid options. Signals are sent by the
FMOE_FAULT test hook at a chosen phase, so every case is deterministic."""
import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fmoe.app import checkpoints, files
from fmoe.app.checkpoints import CheckpointError
from fmoe.app.cli import main
from fmoe.app.data import load_corpus
from fmoe.app.evaluation import harmonic_mean
from fmoe.app.gpt import GPT, GPTConfig, parameter_tensors
from fmoe.gates import GATES
from tests.fs_utils import in_user_namespace, needs_tmpfs
from tests.test_fault_dist import LargestTensor

# The fault-injection runs (kills, signals, full disks) run with FMOE_TEST_FAULTS=1: `make test-faults`, in CI
# (out of `make test`, which keeps its time budget).
pytestmark = pytest.mark.skipif(os.environ.get("FMOE_TEST_FAULTS") != "1",
                                reason="The fault-injection runs (kills, signals, full disks): FMOE_TEST_FAULTS=1 "
                                       "(make test-faults)")

TINY = ["--d-model", "16", "--layers", "1", "--heads", "1", "--seq-len", "16", "--num-expert", "2",
        "--d-hidden", "16", "--batch-size", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(200)))
    return path


def train(corpus, out, steps, *extra):
    return main(["train", *TINY, "--steps", str(steps), "--data", str(corpus), "--out", str(out), "--no-progress",
                 *extra])


def losses(out):
    return json.loads((out / "history.json").read_text())["loss"]


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """An uninterrupted 4-step run: the losses every resumed run must reproduce."""
    out = tmp_path_factory.mktemp("straight")
    assert train(corpus, out, 4, "--gate", "noisy") == 0
    return losses(out)


# --- atomic writes ---------------------------------------------------------------------------------

class FullDisk:
    """A file whose writes fail with ENOSPC after `room` bytes, as on a full disk."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("save", [lambda p: files.write_json(p, {"x": list(range(10_000))}),
                                  lambda p: files.save_torch(p, {"w": torch.randn(10_000)})], ids=["json", "torch"])
def test_atomic_write_on_full_disk_reports_path_and_keeps_previous_file(tmp_path, monkeypatch, save):
    path = tmp_path / "out.bin"
    path.write_bytes(b"previous")
    real_fdopen = os.fdopen
    monkeypatch.setattr(files.os, "fdopen", lambda fd, mode: FullDisk(real_fdopen(fd, mode), room=1000))
    with pytest.raises(files.WriteError, match=f"could not write {path}.*disk full"):
        save(path)
    assert path.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]        # no temporary file left


def test_atomic_write_killed_midway_leaves_previous_file(tmp_path):
    path = tmp_path / "history.json"
    path.write_text('{"old": true}')
    code = ("import os, signal, sys; from fmoe.app.files import write_atomic\n"
            "def half(f): f.write(b'{\"new\": '); f.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
            "write_atomic(sys.argv[1], half)")
    result = subprocess.run([sys.executable, "-c", code, str(path)], timeout=120)
    assert result.returncode == -signal.SIGKILL
    assert json.loads(path.read_text()) == {"old": True}


def test_atomic_write_after_a_kill_removes_the_stale_temporary_file_only(tmp_path):
    """A SIGKILL inside a write leaves `.history.json.XXXXXXXX.tmp`; the next process's save into that
    folder removes it, but not other files nor a temporary newer than itself (a write in progress)."""
    path = tmp_path / "history.json"
    kill = ("import os, signal, sys; from fmoe.app.files import write_atomic\n"
            "def half(f): f.write(b'{'); f.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
            "write_atomic(sys.argv[1], half)")
    assert subprocess.run([sys.executable, "-c", kill, str(path)], timeout=120).returncode == -signal.SIGKILL
    (stale,) = tmp_path.glob(".history.json.*.tmp")
    others = [tmp_path / ".notes.tmp", tmp_path / "data.tmp", tmp_path / ".x.abcdefgh.tmp.keep"]
    for other in others:
        other.write_text("mine")
        os.utime(other, (0, 0))
    in_progress = tmp_path / ".plot.png.zzzzzzzz.tmp"
    in_progress.write_text("half")
    os.utime(in_progress, (time.time() + 3600,) * 2)    # as if written after the next process started
    save = "import sys; from fmoe.app.files import write_json; write_json(sys.argv[1], [1])"
    subprocess.run([sys.executable, "-c", save, str(tmp_path / "checkpoint.json")], check=True, timeout=120)
    assert not stale.exists() and all(p.exists() for p in others) and in_progress.exists()
    assert json.loads((tmp_path / "checkpoint.json").read_text()) == [1]


def test_atomic_write_gives_plain_file_mode(tmp_path):
    files.write_text(tmp_path / "a.txt", "x")
    plain = tmp_path / "b.txt"
    plain.write_text("x")
    assert (tmp_path / "a.txt").stat().st_mode == plain.stat().st_mode


# --- corrupt checkpoints ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run_with_previous(corpus, tmp_path_factory):
    """A finished 3-step run, saved at step 2 and 3: checkpoint.pt and checkpoint.prev.pt."""
    out = tmp_path_factory.mktemp("run")
    assert train(corpus, out, 3, "--save-every", "2") == 0
    return out


def damaged_copy(src, dst, damage):
    data = bytearray(src.read_bytes())
    dst.write_bytes(damage(data))
    return dst


def flip_at(fraction):
    def flip(data):
        i = int(len(data) * fraction)
        data[i] ^= 0xFF
        return bytes(data)
    return flip


@pytest.mark.parametrize("damage, problem", [
    (flip_at(0.3), "corrupt"), (flip_at(0.7), "corrupt"), (flip_at(0.9), "corrupt"),
    (lambda d: bytes(d[:len(d) // 2]), "truncated or corrupt"),
    (lambda d: b"", "is empty"),
    (lambda d: b"hello, not a checkpoint", "truncated or corrupt"),
], ids=["flip30", "flip70", "flip90", "truncated", "empty", "garbage"])
def test_corrupt_checkpoint_is_refused_naming_file_and_previous(run_with_previous, tmp_path, damage, problem):
    prev = run_with_previous / "checkpoint.prev.pt"
    assert checkpoints.load_file(prev)["step"] == 2
    bad = damaged_copy(run_with_previous / "checkpoint.pt", tmp_path / "checkpoint.pt", damage)
    (tmp_path / "checkpoint.prev.pt").write_bytes(prev.read_bytes())
    with pytest.raises(CheckpointError, match=problem) as err:
        checkpoints.load_file(bad)
    message = str(err.value)
    assert str(bad) in message and f"--resume-from {tmp_path / 'checkpoint.prev.pt'}" in message


def test_corrupt_foreign_checkpoint_is_refused(tmp_path):
    torch.save({"model": {}, "step": 3}, tmp_path / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="not an fmoe train checkpoint"):
        checkpoints.load_file(tmp_path / "checkpoint.pt")
    torch.save([1, 2], tmp_path / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="not an fmoe checkpoint"):
        checkpoints.load_file(tmp_path / "checkpoint.pt")


def test_corrupt_checkpoint_on_resume_is_one_line_and_resume_from_previous_works(run_with_previous, tmp_path,
                                                                                 corpus, capsys):
    out = tmp_path / "run"
    out.mkdir()
    damaged_copy(run_with_previous / "checkpoint.pt", out / "checkpoint.pt", flip_at(0.7))
    (out / "checkpoint.prev.pt").write_bytes((run_with_previous / "checkpoint.prev.pt").read_bytes())
    with pytest.raises(SystemExit) as exit_info:
        train(corpus, out, 4, "--resume")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{out / 'checkpoint.pt'} is corrupt" in err and "--resume-from" in err
    assert train(corpus, out, 4, "--resume-from", str(out / "checkpoint.prev.pt")) == 0
    assert json.loads((out / "history.json").read_text())["step"] == [1, 2, 3, 4]


@pytest.mark.parametrize("option, value, saved", [("--d-model", "32", "16"), ("--seq-len", "32", "16"),
                                                   ("--gate", "noisy", "'gshard'"), ("--top-k", "1", "2")])
def test_resume_refuses_a_model_option_that_differs_from_the_checkpoint(run_with_previous, tmp_path, corpus, capsys,
                                                                       option, value, saved):
    out = tmp_path / "run"
    shutil.copytree(run_with_previous, out)
    with pytest.raises(SystemExit) as exit_info:
        train(corpus, out, 4, "--resume", option, value)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{option} {value}" in err and f"checkpoint's {saved}" in err, err
    assert json.loads((out / "history.json").read_text())["step"] == [1, 2, 3]
    # Options not given keep the checkpoint's values (not the defaults): the 16-wide model trains on.
    assert main(["train", "--steps", "4", "--data", str(corpus), "--out", str(out), "--no-progress", "--resume",
                 "--batch-size", "2"]) == 0
    assert torch.load(out / "checkpoint.pt", weights_only=True)["model_config"]["d_model"] == 16


# --- signals at every phase of a step --------------------------------------------------------------

@pytest.mark.parametrize("phase, sig", [("forward", "SIGINT"), ("backward", "SIGTERM"), ("optimizer", "SIGINT"),
                                        ("step", "SIGTERM")])
def test_fault_signal_in_any_phase_saves_and_resumes_exactly(corpus, tmp_path, monkeypatch, straight, phase, sig):
    out = tmp_path / "run"
    monkeypatch.setenv("FMOE_FAULT", f"{phase}:2:{sig}")
    assert train(corpus, out, 4, "--gate", "noisy") == 130
    monkeypatch.delenv("FMOE_FAULT")
    assert checkpoints.load_file(out / "checkpoint.pt")["step"] == 2       # the step in flight was finished
    assert train(corpus, out, 4, "--gate", "noisy", "--resume") == 0
    assert losses(out) == straight                                         # bit for bit


def test_fault_signal_during_final_validation_saves_the_finished_run(corpus, tmp_path, monkeypatch, straight):
    out = tmp_path / "run"
    monkeypatch.setenv("FMOE_FAULT", "validation:4:SIGTERM")
    assert train(corpus, out, 4, "--gate", "noisy") == 130
    state = checkpoints.load_file(out / "checkpoint.pt")
    assert state["step"] == 4 and len(state["history"]["val_loss"]) == 1 and losses(out) == straight


def test_fault_abort_inside_step_rolls_back_then_resumes_exactly(corpus, tmp_path, monkeypatch, straight):
    """A KeyboardInterrupt raised inside a step (a second Ctrl-C) before the update: the step is undone."""
    from fmoe.app import train as train_module

    real = train_module.lr_at

    def ctrl_c_at_step_3(step, total, peak):
        if step == 2:
            raise KeyboardInterrupt
        return real(step, total, peak)

    with monkeypatch.context() as patch:
        patch.setattr(train_module, "lr_at", ctrl_c_at_step_3)
        assert train(corpus, tmp_path, 4, "--gate", "noisy") == 130
    assert checkpoints.load_file(tmp_path / "checkpoint.pt")["step"] == 2
    assert train(corpus, tmp_path, 4, "--gate", "noisy", "--resume") == 0
    assert losses(tmp_path) == straight


def test_harmonic_mean_of_no_steps_is_zero():
    assert harmonic_mean([]) == 0.0 and harmonic_mean([2.0, 2.0]) == 2.0


# --- kills -----------------------------------------------------------------------------------------

def fmoe_cmd(corpus, out, steps, *extra):
    return [sys.executable, "-m", "fmoe.app.cli", "train", *TINY, "--steps", str(steps), "--data", str(corpus),
            "--out", str(out), "--no-progress", *extra]


def test_kill_at_a_random_instant_leaves_a_checkpoint_to_resume(corpus, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(fmoe_cmd(corpus, out, 400, "--save-every", "1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    while not (out / "checkpoint.pt").exists() and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(float(torch.rand(1)) * 0.5)      # any instant: training, or writing a checkpoint
    proc.kill()
    proc.wait()
    step = checkpoints.load_file(out / "checkpoint.pt")["step"]
    assert json.loads((out / "history.json").read_text())["step"][-1] >= step - 1
    assert train(corpus, out, step + 1, "--resume") == 0


def ranks_of(out):
    """Processes whose command line names this run's folder, but not this test process."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if str(out) in cmdline and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def test_kill_of_the_launcher_ends_its_ranks_which_save(corpus, tmp_path):
    """SIGKILL of `fmoe train --nproc 2`'s process group: torchrun and the ranks are told, save a step
    folder and end; the 2-process checkpoint then resumes in one process."""
    out = tmp_path / "ep"
    proc = subprocess.Popen(fmoe_cmd(corpus, out, 400, "--nproc", "2", "--ep-size", "2", "--save-every", "1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    while not (out / "checkpoint" / "latest").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert (out / "checkpoint" / "latest").exists()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    while ranks_of(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ranks_of(out) == []
    folder = checkpoints.load_folder(out / "checkpoint")
    assert len(checkpoints.step_folders(out / "checkpoint")) <= 2       # --keep 2
    step = checkpoints.read_torch(folder / "trainer.pt")["step"]
    assert train(corpus, out, step + 1, "--resume") == 0


def test_kill_during_sharded_save_and_signal_under_nproc(corpus, tmp_path):
    """Rank 1 gets SIGTERM in its backward at step 2: both ranks finish step 2 and save. Then rank 0 is
    killed inside the save of step 4: `latest` still names step 2, whole; a flipped byte in a shard is found."""
    out = tmp_path / "ep"
    env = {**os.environ, "FMOE_FAULT": "backward:2:SIGTERM:1"}
    first = subprocess.run(fmoe_cmd(corpus, out, 6, "--nproc", "2", "--ep-size", "2"), env=env,
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 130 and "interrupted at step 2" in first.stdout, first.stderr[-3000:]
    root = out / "checkpoint"
    assert checkpoints.latest_folder(root).name == "step-00000002"
    env["FMOE_FAULT"] = "save:4:SIGKILL:0"
    second = subprocess.run(fmoe_cmd(corpus, out, 6, "--nproc", "2", "--ep-size", "2", "--resume", "--save-every",
                                     "2"), env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode != 0
    folder = checkpoints.load_folder(root)
    assert folder.name == "step-00000002"
    assert checkpoints.read_torch(folder / "trainer.pt")["step"] == 2

    shard = next(folder.glob("*.distcp"))
    damaged_copy(shard, shard, flip_at(0.5))
    with pytest.raises(CheckpointError, match=f"{shard} is corrupt or truncated"):
        checkpoints.load_folder(root)


# --- invalid options and inputs ----------------------------------------------------------------------

@pytest.mark.parametrize("args, named", [
    (["--aux-coef", "nan"], "--aux-coef"), (["--aux-coef", "-1"], "--aux-coef"), (["--lr", "inf"], "--lr"),
    (["--ep-size", "2"], "--ep-size 2 needs several processes"), (["--nproc", "3", "--ep-size", "2"], "--ep-size"),
    (["--save-every", "-1"], "--save-every"), (["--keep", "0"], "--keep"),
])
def test_invalid_train_option_is_refused_naming_it(corpus, tmp_path, capsys, args, named):
    with pytest.raises(SystemExit) as exit_info:
        train(corpus, tmp_path, 2, *args)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("args, named, why", [
    (["--d-model", "1000000000"], "--d-model 1000000000: attention [3000000000, 1000000000]",
     "more than torch can index"),
    (["--num-expert", "1000000000"], "--num-expert 1000000000: training", "more than the"),
    (["--d-hidden", "100000000000"], "--d-hidden 100000000000: training", "more than the"),
], ids=["d-model", "num-expert", "d-hidden"])
def test_invalid_sizes_that_cannot_fit_are_one_line_before_anything_is_allocated(corpus, tmp_path, capsys, args,
                                                                                  named, why):
    with LargestTensor() as made, pytest.raises(SystemExit) as exit_info:
        train(corpus, tmp_path / "run", 2, *args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"fmoe train: error: {named}") and why in err, err
    assert made.nbytes < 2 ** 20


@pytest.mark.parametrize("gate", sorted(GATES))
def test_the_size_check_counts_the_gpts_parameters(gate):
    """What `fmoe train` checks before building the model is what the model holds (the noisy gate's
    second [D, E] weight aside: there the check counts less, never more)."""
    cfg = GPTConfig(seq_len=8, d_model=16, n_layer=2, n_head=2, num_expert=4, d_hidden=24, gate=gate)
    counted = sum(math.prod(shape) * count for _, shape, count in parameter_tensors(cfg))
    held = sum(p.numel() for p in GPT(cfg).parameters())
    assert counted == held - (cfg.n_layer * (cfg.d_model * cfg.num_expert - cfg.num_expert) if gate == "noisy" else 0)


def unwritable_folder(tmp_path):
    """A folder no file can be created in, also for root (whom chmod does not stop): /proc takes no new
    entries from anyone."""
    if os.geteuid() == 0:
        return Path("/proc/fmoe-out")
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    return folder


@pytest.mark.parametrize("where", ["a file", "under a file", "read-only"])
def test_an_unwritable_out_fails_at_once_naming_it(corpus, tmp_path, capsys, where):
    (tmp_path / "taken").write_text("not a folder")
    out = {"a file": tmp_path / "taken", "under a file": tmp_path / "taken" / "run",
           "read-only": unwritable_folder(tmp_path)}[where]
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        train(corpus, out, 200)
    assert time.perf_counter() - start < 5, "refused before any step"
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"fmoe train: error: --out {str(out)!r}" in err, err
    assert (tmp_path / "taken").read_text() == "not a folder"


@needs_tmpfs
def test_out_on_a_read_only_filesystem_fails_before_any_process_starts(corpus, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    command = " ".join(fmoe_cmd(corpus, disk, 200, "--nproc", "2", "--ep-size", "2"))
    result = in_user_namespace(f"mount -t tmpfs -o ro,size=16k tmpfs {disk} && {command}")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert f"--out {str(disk)!r}" in result.stderr and "Read-only file system" in result.stderr


def test_experts_that_do_not_split_over_the_ranks_fail_before_any_process_starts(corpus, tmp_path):
    start = time.perf_counter()
    result = subprocess.run(fmoe_cmd(corpus, tmp_path / "run", 2, "--nproc", "2", "--ep-size", "2",
                                     "--num-expert", "3"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "--num-expert 3" in result.stderr and "--ep-size 2" in result.stderr
    assert time.perf_counter() - start < 60, "no torchrun, no ranks"


def test_invalid_fault_spec_is_named(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FMOE_FAULT", "sideways:1:SIGINT")
    with pytest.raises(SystemExit):
        train(corpus, tmp_path, 2)
    assert "FMOE_FAULT" in capsys.readouterr().err


def test_bad_input_big_data_file_is_read_only_as_far_as_kept(tmp_path, monkeypatch):
    big = tmp_path / "big.txt"
    big.write_bytes(b"x = 1\n" * 200_000)
    reads = []
    real_open = open

    class Spy:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            reads.append(n)
            return self.f.read(n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    import fmoe.app.data
    monkeypatch.setattr(fmoe.app.data, "open", lambda *a, **k: Spy(real_open(*a, **k)), raising=False)
    corpus = load_corpus(str(big), seq_len=16, max_bytes=10_000)
    assert corpus.num_bytes == 10_000 and corpus.truncated
    assert all(0 <= n <= 10_000 for n in reads)


# --- a one-process checkpoint on expert-parallel ranks --------------------------------------------------

def _load_full_on_rank(rank, world, state_file):
    from types import SimpleNamespace

    from fmoe.app.gpt import GPT, GPTConfig
    from fmoe.app.runtime import TrainConfig
    from fmoe.app.train import Trainer, make_optimizer
    from fmoe.distributed.groups import make_groups

    state = torch.load(state_file, weights_only=True)
    cfg = GPTConfig(**state["model_config"])
    groups = make_groups(world)
    model = GPT(cfg, world, groups.moe_group)
    optimizer = make_optimizer(model, TrainConfig())
    Trainer.load_full_state_into_shard(SimpleNamespace(model=model, optimizer=optimizer), state)
    e = cfg.num_expert // world
    full_params = state["model"]
    names = {p: n for n, p in model.named_parameters()}
    ordered = [p for group in optimizer.param_groups for p in group["params"]]     # the optimizer's indices
    for i, p in enumerate(ordered):
        name = names[p]
        expected = full_params[name]
        if ".experts." in name:
            expected = expected[rank * e:(rank + 1) * e]
        assert torch.equal(p.detach(), expected), name
        saved = state["optimizer"]["state"][i]["exp_avg"]
        if ".experts." in name:
            saved = saved[rank * e:(rank + 1) * e]
        assert torch.equal(optimizer.state[p]["exp_avg"], saved), name
    assert len(ordered) == len(state["optimizer"]["state"])


def test_fault_free_one_process_checkpoint_loads_on_expert_parallel_ranks(run_with_previous):
    from tests.dist_utils import run_ranks

    state = checkpoints.load_file(run_with_previous / "checkpoint.pt")
    path = run_with_previous / "plain-state.pt"
    torch.save(state, path)
    run_ranks(_load_full_on_rank, 2, str(path))


# --- exact resume on expert-parallel ranks ----------------------------------------------------------

RESUME_CASES = [("backward:2:SIGTERM:1", 2), ("optimizer:2:SIGINT:0", 2), ("optimizer:2:SIGTERM:1", 1)]
# (FMOE_FAULT, --ep-size) on 2 ranks


def _resume_on_rank(rank, world, corpus, root, ports):
    """Every run of RESUME_CASES on this rank, each through `fmoe.app.train.train` as under torchrun:
    per --ep-size an uninterrupted run, then per fault an interrupted run and its --resume."""
    from fmoe.app.gpt import GPTConfig
    from fmoe.app.runtime import Interrupted, TrainConfig
    from fmoe.app.train import train as run
    from tests.dist_utils import exit_without_teardown, retry_gloo_init_in_this_process

    torch.set_num_threads(1)
    retry_gloo_init_in_this_process()              # init_distributed's gloo connect, retried if refused
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    ports = iter(ports)
    model_cfg = GPTConfig(seq_len=16, d_model=16, n_layer=1, n_head=1, num_expert=4, d_hidden=16, gate="noisy")

    def once(out, ep_size, fault=None, resume=False):
        os.environ["MASTER_PORT"] = str(next(ports))
        os.environ.pop("FMOE_FAULT", None)
        if fault:
            os.environ["FMOE_FAULT"] = fault
        cfg = TrainConfig(steps=3, batch_size=2, data=str(corpus), out=str(out), ep_size=ep_size, resume=resume,
                          eval_batches=1, sample_bytes=0, device="cpu")
        try:
            run(cfg, model_cfg, log=lambda message: None, progress=False)
            return 0
        except Interrupted:
            return 130

    for ep_size in (2, 1):
        assert once(root / f"straight-ep{ep_size}", ep_size) == 0
    for i, (fault, ep_size) in enumerate(RESUME_CASES):
        out = root / f"case{i}"
        assert once(out, ep_size, fault) == 130, fault
        assert once(out, ep_size, resume=True) == 0, fault
    exit_without_teardown()


def test_fault_signal_on_one_rank_resumes_exactly_under_nproc_2(corpus, tmp_path):
    """SIGINT / SIGTERM to one of 2 ranks in its backward or after optimizer.step(), with --ep-size 2 and 1:
    both ranks finish the step and save; --resume then gives the uninterrupted run's losses bit for bit."""
    import torch.multiprocessing as mp

    from tests.dist_utils import free_port

    ports = [free_port() for _ in range(2 + 2 * len(RESUME_CASES))]
    mp.spawn(_resume_on_rank, args=(2, corpus, tmp_path, ports), nprocs=2, join=True)
    for i, (fault, ep_size) in enumerate(RESUME_CASES):
        history = json.loads((tmp_path / f"case{i}" / "history.json").read_text())
        assert history["step"] == [1, 2, 3], fault
        assert history["loss"] == losses(tmp_path / f"straight-ep{ep_size}"), fault
        assert checkpoints.step_folders(tmp_path / f"case{i}" / "checkpoint")[0].name == "step-00000002", fault
