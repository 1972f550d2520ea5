"""RoutingStatsCallback: every fmoe MoE layer's routing statistics in the logs of a transformers Trainer."""
from transformers import Trainer, TrainerCallback

from fmoe.load_balancing import register_bias_update_if_needed
from fmoe.observe.stats import RoutingStatsMeter, scalars


class RoutingStatsCallback(TrainerCallback):
    """Adds `routing/<layer>/<statistic>` (see `fmoe.observe.stats`) of every MoE layer to each training log,
    summed over all the training forwards since the previous log: every micro-batch of gradient
    accumulation, each once (gradient checkpointing's recompute is not counted again).

    The Trainer hands each log to its callbacks in order, and puts those of `callbacks=` after its
    reporting ones (TensorBoard, W&B, ...), which would then never see these: attach it with
    `RoutingStatsCallback.add_to(trainer)`, which puts it first. `over="world"` sums the counts over
    all ranks (every rank logs, so every rank takes part); by default each rank logs its own tokens.
    """

    def __init__(self, over="rank"):
        self.over = over
        self.meter = None

    @classmethod
    def add_to(cls, trainer: Trainer, over="rank") -> "RoutingStatsCallback":
        callback = cls(over)
        trainer.callback_handler.callbacks.insert(0, callback)
        return callback

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.meter = RoutingStatsMeter(model)

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Training logs carry "loss"; evaluation ("eval_loss") and the final summary ("train_loss") do not.
        if self.meter is not None and logs is not None and "loss" in logs:
            logs.update(scalars(self.meter.read(self.over)))

    def on_train_end(self, args, state, control, **kwargs):
        self.meter.close()
        self.meter = None


class BiasUpdateCallback(TrainerCallback):
    """Moves every updated selection bias once per optimizer step of a transformers Trainer, from the
    load of all of that step's micro-batches (`fmoe.register_bias_update` on the Trainer's optimizer)."""

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        register_bias_update_if_needed(model, optimizer)
