"""`fmoe train --hf-model PATH`: a saved transformers MoE checkpoint fine-tuned (Qwen3-MoE in 1 process,
DeepSeek-V3 with EP=2 on 2 gloo ranks through torchrun), exported, and loaded back by plain
transformers with a lower loss."""
import json
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from fmoe.app.cli import main  # noqa: E402
from fmoe.integrations.hf.finetune import small_model  # noqa: E402
from tests.test_train import scalar_events  # noqa: E402

RUN = ["--steps", "3", "--batch-size", "4", "--seq-len", "32", "--no-progress"]


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(200)))
    return path


def saved(tmp_path, family):
    path = tmp_path / family
    small_model(family).save_pretrained(path)
    return path


def byte_loss(model, corpus_file) -> float:
    ids = torch.tensor([list(corpus_file.read_bytes()[:4 * 33])]).view(4, 33)
    with torch.no_grad():
        return model.eval()(input_ids=ids, labels=ids).loss.item()


def check_export(out, before, corpus_file, steps=3):
    """`out` holds a plain transformers checkpoint of the same family, with a lower loss than `before`."""
    # Beside the checkpoint: the run's history, and its TensorBoard logs when tensorboard is installed.
    assert sorted(p.name for p in out.iterdir() if p.name != "tensorboard") == [
        "config.json", "generation_config.json", "history.json", "model.safetensors"]
    history = json.loads((out / "history.json").read_text())
    assert history["step"] == list(range(1, steps + 1))
    after = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(after) is type(before)
    assert byte_loss(after, corpus_file) < byte_loss(before, corpus_file) - 0.1
    return after


def test_one_process(tmp_path, corpus_file):
    model_dir, out = saved(tmp_path, "qwen3_moe"), tmp_path / "out"
    assert main(["train", "--hf-model", str(model_dir), *RUN, "--data", str(corpus_file), "--out", str(out),
                 "--log", "tensorboard"]) == 0
    check_export(out, transformers.AutoModelForCausalLM.from_pretrained(model_dir), corpus_file)
    scalars = scalar_events(out / "tensorboard")
    steps = json.loads((out / "history.json").read_text())["step"]
    for layer in range(2):
        assert [s for s, _ in scalars[f"routing/model.layers.{layer}.mlp.moe/max_load"]] == steps


def test_two_ranks_expert_parallel(tmp_path, corpus_file):
    """DeepSeek-V3: a dense first layer, shared experts, group-limited routing."""
    model_dir, out = saved(tmp_path, "deepseek_v3"), tmp_path / "out"
    cmd = [sys.executable, "-m", "fmoe.app.cli", "train", "--hf-model", str(model_dir), "--nproc", "2",
           "--ep-size", "2", *RUN, "--data", str(corpus_file), "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 processes, expert-parallel size 2" in result.stdout
    before = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    after = check_export(out, before, corpus_file)
    # Both ranks' experts were trained and gathered: every one of the 8 moved.
    for old, new in zip(before.state_dict().items(), after.state_dict().items()):
        if ".experts." in old[0]:
            assert new[1].shape[0] == 8
            assert all(not torch.equal(a, b) for a, b in zip(old[1], new[1])), old[0]


@pytest.mark.parametrize("extra, message", [
    (["--resume"], "--resume does not apply with --hf-model"),
    (["--d-model", "32", "--compile"], "--d-model, --compile do not apply"),
])
def test_refuses_gpt_and_resume_options(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--hf-model", str(tmp_path), *extra, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_refuses_a_folder_without_a_checkpoint_and_a_small_vocabulary(tmp_path, corpus_file, capsys):
    args = [*RUN, "--data", str(corpus_file), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit):
        main(["train", "--hf-model", str(tmp_path / "nothing"), *args])
    assert "expected a local transformers checkpoint folder with a config.json" in capsys.readouterr().err
    config = small_model().config
    config.vocab_size = 100
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "small-vocab")
    with pytest.raises(SystemExit):
        main(["train", "--hf-model", str(tmp_path / "small-vocab"), *args])
    assert "vocabulary (100) must hold the corpus's 256 byte tokens" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
