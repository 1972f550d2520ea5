"""`fmoe train` end to end on a tiny model and corpus, the GPT, the corpus, and `fmoe info`."""
import importlib.machinery
import json
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.nn.functional as F

import fmoe.app.runtime
import fmoe.observe.dashboards
from fmoe.app.cli import main
from fmoe.app.data import BatchSampler, load_corpus
from fmoe.app.gpt import GPT, GPTConfig
from fmoe.app.train import lr_at
from fmoe.layer import FMoE, collect_aux_loss

TINY_MODEL = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--num-expert", "4",
              "--d-hidden", "64", "--batch-size", "4"]


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400)))
    return path


def run_train(corpus_file, out, steps, *extra):
    return main(["train", *TINY_MODEL, "--steps", str(steps), "--data", str(corpus_file), "--out", str(out),
                 "--no-progress", *extra])


def test_gpt_forward_shapes_loss_and_loads():
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=16, d_model=32, n_layer=3, n_head=4, num_expert=4, gate="noisy", d_hidden=64)
    model = GPT(cfg)
    idx_BT = torch.randint(0, 256, (2, 16))
    logits_BTV, loss = model(idx_BT, idx_BT)
    assert logits_BTV.shape == (2, 16, 256)
    ce = F.cross_entropy(logits_BTV.flatten(0, 1), idx_BT.flatten())
    torch.testing.assert_close(loss, ce + cfg.aux_coef * collect_aux_loss(model))
    loads_LE = model.expert_loads()
    assert loads_LE.shape == (3, 4)
    assert loads_LE.sum(-1).tolist() == [2 * 16 * 2] * 3       # every token routed to top-2, nothing dropped
    assert model(idx_BT[:, :5])[1] is None


def test_gpt_config_checks():
    assert GPTConfig(gate="switch").top_k == 1 and GPTConfig(gate="noisy").top_k == 2
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(d_model=30, n_head=4)
    model = GPT(GPTConfig(seq_len=8, d_model=16, n_layer=1, n_head=2, num_expert=2, d_hidden=16))
    with pytest.raises(ValueError, match="exceeds the model's seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_batches_are_seeded_next_byte_windows():
    bytes_N = torch.arange(100, dtype=torch.uint8)
    x_BT, y_BT = BatchSampler(bytes_N, 3, 10, seed=1).next()
    assert x_BT.shape == y_BT.shape == (3, 10) and x_BT.dtype == torch.long
    assert torch.equal(y_BT, x_BT + 1)
    assert torch.equal(BatchSampler(bytes_N, 3, 10, seed=1).next()[0], x_BT)


def test_default_corpus_is_the_stdlib_in_a_fixed_order():
    first, again = load_corpus(max_bytes=20_000), load_corpus(max_bytes=20_000)
    assert first.num_bytes == 20_000 and first.truncated
    assert torch.equal(first.train_N, again.train_N) and torch.equal(first.val_N, again.val_N)


def test_bad_data_fails_naming_data(tmp_path, capsys):
    with pytest.raises(ValueError, match="--data .*no such file or folder"):
        load_corpus(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blob.bin").write_bytes(b"\0\1\2")
    with pytest.raises(ValueError, match="--data .*holds no text"):
        load_corpus(str(tmp_path / "empty"))
    (tmp_path / "small.txt").write_text("too short")
    with pytest.raises(ValueError, match="--data .*too few for --seq-len 32"):
        load_corpus(str(tmp_path / "small.txt"), seq_len=32)
    with pytest.raises(SystemExit) as exit_info:
        run_train(tmp_path / "missing", tmp_path / "out", 5)
    assert exit_info.value.code == 2
    assert "fmoe train: error: --data" in capsys.readouterr().err


def test_binary_data_is_never_trained_on_file_or_folder(tmp_path, corpus_file):
    """One rule: only text files are read (no NUL byte in the first 8 KiB), named or found in a folder."""
    blob = tmp_path / "data" / "blob.bin"
    blob.parent.mkdir()
    blob.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(ValueError, match=f"--data '{blob}' is not a text file"):
        load_corpus(str(blob), seq_len=32)
    (tmp_path / "data" / "corpus.txt").write_bytes(corpus_file.read_bytes())
    corpus = load_corpus(str(tmp_path / "data"), seq_len=32)
    assert corpus.num_files == 1 and corpus.num_bytes == corpus_file.stat().st_size


def test_train_writes_checkpoint_history_plot_and_resumes(corpus_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_train(corpus_file, out, 5) == 0
    printed = capsys.readouterr().out
    assert "checkpoint:" in printed and "sample:" in printed

    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["step"] == 5 and state["model_config"]["d_model"] == 32
    assert {"model", "optimizer", "train_config"} <= state.keys()
    history = json.loads((out / "history.json").read_text())
    assert history["step"] == [1, 2, 3, 4, 5]
    assert all(torch.isfinite(torch.tensor(history["loss"])))
    assert torch.tensor(history["load_share"]).shape == (5, 2, 4)
    assert len(history["tokens_per_s"]) == 5 and len(history["val_loss"]) == 1
    png = (out / "training.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000

    assert run_train(corpus_file, out, 8, "--resume") == 0
    resumed = json.loads((out / "history.json").read_text())
    assert resumed["step"] == list(range(1, 9)) and resumed["loss"][:5] == history["loss"]
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 8



def test_train_under_the_gpu_path_bf16_autocast(corpus_file, tmp_path, monkeypatch):
    """fmoe train's GPU path, bf16 autocast, here on the CPU: the MoE layers run in bf16 in every
    forward (training, validation, sampling) and the run trains."""
    monkeypatch.setattr(fmoe.app.runtime, "autocast", lambda device: torch.autocast(device.type, dtype=torch.bfloat16))
    dtypes = set()
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: dtypes.add(out.dtype) if isinstance(module, FMoE) else None)
    try:
        assert run_train(corpus_file, tmp_path / "run", 3) == 0
    finally:
        handle.remove()
    assert dtypes == {torch.bfloat16}
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    assert all(torch.isfinite(torch.tensor(history["loss"]))) and len(history["val_loss"]) == 1


def scalar_events(folder) -> dict:
    """{tag: [(step, value), ...]} of the TensorBoard event files in `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_holds_each_layers_load_every_step(corpus_file, tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    assert run_train(corpus_file, out, 5, "--gate", "gshard", "--log", "tensorboard") == 0
    history = json.loads((out / "history.json").read_text())
    scalars = scalar_events(out / "tensorboard")
    assert [v for _, v in scalars["train/loss"]] == pytest.approx(history["loss"], rel=1e-6)
    assert scalars["val/loss"] == [(5, pytest.approx(history["val_loss"][0][1], rel=1e-6))]
    for layer in range(2):
        tag = f"routing/blocks.{layer}.moe"
        counts_SE = torch.tensor([[v for _, v in scalars[f"{tag}/tokens_per_expert/{e}"]] for e in range(4)]).T
        assert [s for s, _ in scalars[f"{tag}/max_load"]] == [1, 2, 3, 4, 5]
        share_SE = torch.tensor(history["load_share"])[:, layer]
        torch.testing.assert_close(counts_SE / counts_SE.sum(-1, keepdim=True), share_SE)
        no_expert_S = torch.tensor([[v for _, v in scalars[f"{tag}/{k}"]] for k in ("dropped_slots", "unrouted_slots")])
        torch.testing.assert_close(counts_SE.sum(-1) + no_expert_S.sum(0), torch.full((5,), 4.0 * 32 * 2))
        assert [v for _, v in scalars[f"{tag}/max_load"]] == counts_SE.max(-1).values.tolist()
        for key in ("mean_load", "load_cv", "empty_experts", "router_entropy"):
            assert len(scalars[f"{tag}/{key}"]) == 5, key


def test_log_none_writes_no_dashboard_and_bad_log_fails(corpus_file, tmp_path, capsys):
    assert run_train(corpus_file, tmp_path / "quiet", 1, "--log", "none") == 0
    assert not (tmp_path / "quiet" / "tensorboard").exists() and not (tmp_path / "quiet" / "wandb").exists()
    with pytest.raises(SystemExit):
        run_train(corpus_file, tmp_path / "bad", 1, "--log", "tensorbord")
    assert "--log must be tensorboard, wandb, both comma-separated, or none, got 'tensorbord'" in capsys.readouterr().err


def broken_module(name: str, error: Exception, attribute: str) -> types.ModuleType:
    """A module that imports but raises `error` where `attribute` is read, as a tensorboard whose protobuf
    is the wrong version, or wandb with no API key, does."""
    def fail(*args, **kwargs):
        raise error

    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__getattr__ = lambda key: fail() if key == attribute else None
    return module


TENSORBOARD_BROKEN = TypeError("Descriptors cannot be created directly.")
NO_WANDB_KEY = RuntimeError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")


def test_a_tensorboard_that_cannot_open_is_one_warning_by_default(corpus_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        broken_module("torch.utils.tensorboard", TENSORBOARD_BROKEN, "SummaryWriter"))
    monkeypatch.setattr(fmoe.observe.dashboards, "installed", lambda backend: True)
    with pytest.warns(UserWarning, match="tensorboard cannot open .*TypeError: Descriptors") as caught:
        assert run_train(corpus_file, tmp_path / "run", 2, "--log", "none") == 0 and not caught   # asks for none
        assert run_train(corpus_file, tmp_path / "run", 2) == 0
    assert len([w for w in caught if "cannot open" in str(w.message)]) == 1
    assert json.loads((tmp_path / "run" / "history.json").read_text())["step"] == [1, 2]


@pytest.mark.parametrize("log, module, attribute, error", [
    ("tensorboard", "torch.utils.tensorboard", "SummaryWriter", TENSORBOARD_BROKEN),
    ("wandb", "wandb", "init", NO_WANDB_KEY),
    ("tensorboard,wandb", "wandb", "init", NO_WANDB_KEY),
])
def test_an_asked_for_dashboard_that_cannot_open_stops_before_training(corpus_file, tmp_path, monkeypatch, capsys,
                                                                      log, module, attribute, error):
    monkeypatch.setitem(sys.modules, module, broken_module(module, error, attribute))
    monkeypatch.setattr(fmoe.observe.dashboards, "installed", lambda backend: True)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run_train(corpus_file, out, 2, "--log", log)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    backend = module.split(".")[-1]
    assert err.startswith(f"fmoe train: error: --log {log}: {backend} cannot open ({type(error).__name__}: "), err
    assert not (out / "history.json").exists() and not (out / "checkpoint.pt").exists()


def test_wandb_offline_run_holds_the_routing_statistics(corpus_file, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    assert run_train(corpus_file, out, 2, "--log", "wandb") == 0
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # W&B's own service process writes the run file, and may finish a moment after the run did.
    deadline = time.monotonic() + 60
    while b"routing/blocks.1.moe/tokens_per_expert/3" not in runs[0].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.5)
    records = runs[0].read_bytes()
    assert b"routing/blocks.1.moe/tokens_per_expert/3" in records and b"train/loss" in records


def test_interrupted_run_resumes_where_it_stopped(corpus_file, tmp_path, monkeypatch):
    assert run_train(corpus_file, tmp_path / "straight", 8, "--gate", "noisy") == 0
    straight = json.loads((tmp_path / "straight" / "history.json").read_text())

    def ctrl_c_at_step_5(step, total, peak):
        if step == 5:
            raise KeyboardInterrupt
        return lr_at(step, total, peak)

    with monkeypatch.context() as patch:
        patch.setattr("fmoe.app.train.lr_at", ctrl_c_at_step_5)
        assert run_train(corpus_file, tmp_path / "run", 8, "--gate", "noisy") == 130
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["step"] == 5
    assert run_train(corpus_file, tmp_path / "run", 8, "--gate", "noisy", "--resume") == 0
    resumed = json.loads((tmp_path / "run" / "history.json").read_text())
    # The optimizer, the lr schedule and every random stream (batches, gate noise) carry over exactly.
    assert resumed["loss"] == pytest.approx(straight["loss"], rel=1e-5)


def test_resume_needs_a_checkpoint_and_more_steps(corpus_file, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_train(corpus_file, tmp_path / "none", 5, "--resume")
    assert "--resume: no checkpoint at" in capsys.readouterr().err
    assert run_train(corpus_file, tmp_path / "run", 3) == 0
    with pytest.raises(SystemExit):
        run_train(corpus_file, tmp_path / "run", 3, "--resume")
    assert "already at step 3" in capsys.readouterr().err


def test_info_runs():
    result = subprocess.run([sys.executable, "-m", "fmoe", "info"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "torch" in result.stdout and "device" in result.stdout and "kernel backends:" in result.stdout


def test_train_on_two_processes_with_expert_parallelism_and_reshard_on_resume(corpus_file, tmp_path):
    out = tmp_path / "ep"
    base = [sys.executable, "-m", "fmoe.app.cli", "train", *TINY_MODEL, "--data", str(corpus_file), "--out", str(out),
            "--no-progress", "--nproc", "2"]
    first = subprocess.run(base + ["--steps", "4", "--ep-size", "2"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "expert-parallel size 2" in first.stdout
    assert (out / "checkpoint" / (out / "checkpoint" / "latest").read_text().strip() / "trainer.pt").exists()
    # Resume the same run with all experts on every rank (expert-parallel size 1): the checkpoint reshards.
    second = subprocess.run(base + ["--steps", "6", "--ep-size", "1", "--resume"], capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "done: step 6" in second.stdout
    history = json.loads((out / "history.json").read_text())
    assert history["step"] == list(range(1, 7)) and all(map(lambda v: v == v, history["loss"]))
    # Rank 0 logged the load of both ranks' tokens: 2 x batch 4 x 32 bytes x top-2 slots per layer and step.
    scalars = scalar_events(out / "tensorboard")
    slots_KS = [[v for _, v in scalars[f"routing/blocks.0.moe/{key}"]]
                for key in ("tokens_per_expert/0", "tokens_per_expert/1", "tokens_per_expert/2", "tokens_per_expert/3",
                            "dropped_slots", "unrouted_slots")]
    assert [sum(step) for step in zip(*slots_KS)] == [2 * 4 * 32 * 2] * 6


def test_train_overlap_runs_two_interleaved_micro_batches_equal_to_the_whole_batch(corpus_file, tmp_path):
    """--overlap on 2 expert-parallel processes: the loss curve of the whole-batch step, to fp32
    rounding (the cross-entropy's mean splits over the halves; a balance loss or a capacity would be
    each half's, so the naive gate and no balance loss here)."""
    runs = {}
    for name, extra in (("whole", []), ("overlap", ["--overlap"])):
        out = tmp_path / name
        cmd = [sys.executable, "-m", "fmoe.app.cli", "train", *TINY_MODEL, "--aux-coef", "0", "--gate", "naive", "--data",
               str(corpus_file), "--out", str(out), "--no-progress", "--nproc", "2", "--ep-size", "2", "--steps", "4", *extra]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = json.loads((out / "history.json").read_text())
    assert runs["overlap"]["step"] == [1, 2, 3, 4]
    torch.testing.assert_close(torch.tensor(runs["overlap"]["loss"]), torch.tensor(runs["whole"]["loss"]),
                               rtol=1e-5, atol=1e-5)


def test_train_overlap_needs_an_even_batch():
    from fmoe.app.runtime import TrainConfig
    with pytest.raises(ValueError, match="--batch-size must be even"):
        TrainConfig(batch_size=3, overlap=True)
