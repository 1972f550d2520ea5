"""RoutingStatsCallback in a real transformers Trainer run: each layer's load in its TensorBoard logs."""
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
pytest.importorskip("tensorboard")

import transformers  # noqa: E402

import fmoe  # noqa: E402
import fmoe.integrations.hf  # noqa: E402
from fmoe.integrations.hf import RoutingStatsCallback  # noqa: E402
from tests import hf_models  # noqa: E402
from tests.test_stats import reference  # noqa: E402
from tests.test_train import scalar_events  # noqa: E402


def test_trainer_logs_each_layers_load_over_the_micro_batches_of_a_step(tmp_path):
    torch.manual_seed(0)
    model = fmoe.integrations.hf.convert(transformers.AutoModelForCausalLM.from_config(hf_models.config("qwen3_moe")))
    layers = {name: m for name, m in model.named_modules() if isinstance(m, fmoe.FMoE)}
    assert len(layers) == 2
    routed = {name: [] for name in layers}      # (expert_idx_TK, router logits) of every forward
    for name, layer in layers.items():
        layer.gate_hook = lambda idx, w, _, name=name, layer=layer: routed[name].append(
            (idx.clone(), layer.gate.last_logits_TE.detach()))
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(1, hf_models.VOCAB, (12, 16))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                          gradient_accumulation_steps=2, logging_steps=1, report_to=["tensorboard"],
                                          save_strategy="no", use_cpu=True, disable_tqdm=True, learning_rate=1e-3)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    RoutingStatsCallback.add_to(trainer)
    trainer.train()

    (events_dir,) = {p.parent for p in tmp_path.glob("runs/*/events.out.tfevents.*")}
    scalars = scalar_events(events_dir)
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3]
    for name in layers:
        assert len(routed[name]) == 6, "two micro-batches a step"
        for step in range(3):
            micro = routed[name][2 * step:2 * step + 2]
            expected = reference(torch.cat([idx for idx, _ in micro]), torch.cat([lg for _, lg in micro]),
                                 unrouted_by_gate=False)
            for key, value in expected.items():
                if key == "tokens_per_expert":
                    got = [scalars[f"train/routing/{name}/{key}/{e}"][step][1] for e in range(len(value))]
                else:
                    got = scalars[f"train/routing/{name}/{key}"][step][1]
                assert got == pytest.approx(value, rel=1e-5), (name, step, key)
