"""FunctionTrainer: bring your own training loop; the engine runs it, schedulers control it.

A :class:`FunctionTrainer` wraps a plain function ``train(model, hparams, session)`` that trains
as it likes and calls ``session.report(step, **metrics)`` after each step, ``session.save(state)``
to checkpoint and ``session.load()`` to restart. Every strategy, scheduler (median stopping,
ASHA, Hyperband, HyperTrick, PBT), executor and resume path works with it; how a function is
run one segment at a time is :mod:`.function_run` (``NOTE: [Function segments]``). With no
space (``Experiment(None, strategy, FunctionTrainer(...))``) the function gets ``model=None``
and the engine is a plain hyper-parameter tuner. docs/function_trainer.md ports a loop to it.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from torch import nn

from ...choices import ValueChoice
from ...refs import ref_of, resolve_ref
from ...space import ModelSpace
from ..jobs.worker_refs import object_ref
from .trainer import Trainer
from .trial_training import check_segment

__all__ = ["FunctionTrainer", "NO_MODEL", "NO_MODEL_REF", "experiment_space",
           "is_function_spec", "open_function_task", "NOT_OPTIMIZED"]


class _NoModel(nn.Module):
    """The one model of a model-free search: nothing to train (the function gets None)."""

    def forward(self, x):
        return x


# The space of a model-free search: one structure, so the trainer's ValueChoices alone make
# the models (and dedup compares their values). Module level: workers import it by reference.
NO_MODEL = ModelSpace(_NoModel())
NO_MODEL_REF = "retiarii.engine.trainers.function_trainer:NO_MODEL"

# What `retiarii status` says, once, of a run whose trainer is a FunctionTrainer.
NOT_OPTIMIZED = ("cross-model optimization: does not apply (a FunctionTrainer trains each model "
                 "alone, in its own loop)")

_NO_HOOKS = ("a FunctionTrainer has no per-batch hooks: the engine runs its function, one "
             "segment at a time (retiarii.engine.trainers.function_run.FunctionRun); train it through "
             "rt.Experiment, or FunctionRun to run one trial by hand")


class FunctionTrainer(Trainer):
    """Train each model with your own function.

    Example::

        def train(model, hparams, session):          # module level: workers import it
            opt = torch.optim.Adam(model.parameters(), lr=hparams["lr"])
            state, start = session.load(), 0
            if state is not None:
                model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
                start = state["epoch"]
            for epoch in range(start, hparams["epochs"]):
                ...                                    # your epoch, your validation
                session.save({"model": model.state_dict(), "opt": opt.state_dict(),
                              "epoch": epoch + 1})
                session.report(epoch + 1, val_acc=acc)

        trainer = rt.FunctionTrainer(train, epochs=10, lr=rt.ValueChoice([1e-3, 3e-3]))

    Args:
        train: ``train(model, hparams, session)``, a module-level function (or its reference
            ``"pkg.module:name"``): worker processes import it.
        epochs: steps of a full trial (``hparams["epochs"]``; the schedulers' unit is one
            ``report``).
        settings: hyper-parameters handed to the function in ``hparams``: plain JSON values,
            or ValueChoices that the strategy explores with the architecture choices.
    """

    def __init__(self, train: Callable | str, epochs: int = 1, **settings: Any):
        if not (callable(train) or isinstance(train, str)):
            raise TypeError(f"FunctionTrainer(train={train!r}): give the training function "
                            f"train(model, hparams, session), or its reference 'pkg.mod:name'")
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise TypeError(f"FunctionTrainer(epochs={epochs!r}): give the steps of a full "
                            f"trial, an int >= 1 (a ValueChoice of it is not supported: the "
                            f"schedulers need one length)")
        self._train = train
        self.epochs = epochs
        self.settings = dict(settings)

    @property
    def function(self) -> Callable:
        """The training function (a reference is imported on first use)."""
        if isinstance(self._train, str):
            function = resolve_ref(self._train)
            if not callable(function):
                raise TypeError(f"FunctionTrainer(train={self._train!r}) names a "
                                f"{type(function).__name__}, not a function")
            self._train = function
        return self._train

    def function_name(self) -> str:
        train = self._train
        return train if isinstance(train, str) else getattr(train, "__qualname__", repr(train))

    def defaults(self) -> dict[str, Any]:
        """The ``hparams`` a trial gets before its own values: ``epochs`` and every setting
        (a ValueChoice at its default)."""
        return {"epochs": self.epochs,
                **{k: v.default if isinstance(v, ValueChoice) else v
                   for k, v in self.settings.items()}}

    def value_choices(self) -> dict[str, ValueChoice]:
        return {k: v for k, v in self.settings.items() if isinstance(v, ValueChoice)}

    def to_spec(self) -> dict:
        """``{"class": FunctionTrainer, "config": {"train": ref, "epochs": N, ...}}``: workers
        rebuild the trainer from it and import the function by its reference."""
        train = self._train if isinstance(self._train, str) else \
            object_ref(self._train, "training function")
        config = {"train": train, **self.defaults()}
        for name, value in config.items():
            try:
                json.dumps(value)
            except TypeError:
                raise TypeError(f"FunctionTrainer setting {name}={value!r} is not JSON: workers "
                                f"rebuild the trainer from its settings; give plain values "
                                f"(numbers, strings, lists) and load anything larger inside "
                                f"the function") from None
        return {"class": ref_of(FunctionTrainer), "config": config}

    # A FunctionTrainer is driven by FunctionRun, never by TrialRun's per-batch calls.
    def configure_optimizers(self, model: nn.Module, hparams: dict) -> Any:
        raise TypeError(_NO_HOOKS)

    def train_dataloader(self, hparams: dict, epoch: int):
        raise TypeError(_NO_HOOKS)

    def val_dataloader(self, hparams: dict):
        raise TypeError(_NO_HOOKS)

    def training_step(self, model: nn.Module, batch: Any, hparams: dict):
        raise TypeError(_NO_HOOKS)

    def validation_step(self, model: nn.Module, batch: Any):
        raise TypeError(_NO_HOOKS)

    def __repr__(self) -> str:
        return f"FunctionTrainer({self.function_name()}, epochs={self.epochs}, {self.settings})"


def is_function_spec(spec: Any) -> bool:
    """Whether a stored trainer spec (the experiment's config) is a FunctionTrainer's."""
    return isinstance(spec, dict) and str(spec.get("class", "")).endswith(":FunctionTrainer")


def experiment_space(space: Any, trainer: Any, one_shot: bool, error: type[Exception]) -> Any:
    """The space an experiment searches: ``space``, or with None (a FunctionTrainer only) the
    model-free :data:`NO_MODEL`; ``error`` names what cannot work."""
    function = isinstance(trainer, FunctionTrainer)
    if function and one_shot:
        raise error("a one-shot (weight-sharing) search trains one super-network through the "
                    "trainer's per-batch hooks, which a FunctionTrainer does not have: use a "
                    "multi-trial strategy, or a Trainer subclass")
    if space is not None:
        return space
    if not function:
        raise error("space=None (a model-free search) needs a FunctionTrainer: give a "
                    "ModelSpace, or rt.FunctionTrainer(train, ...) whose function builds its "
                    "own model")
    return NO_MODEL_REF


def open_function_task(task: Any, space: Any, trainer: FunctionTrainer) -> Any:
    """A worker's :class:`~.function_run.FunctionRun` for ``task`` (at its start step)."""
    from .function_run import FunctionRun

    spec = task.spec
    build = None
    if space is not NO_MODEL:
        sample = spec["sample"]
        # The driver already checked this sample's shapes (spec "checked"): not twice.
        kwargs = {"check": False} if spec.get("checked") else {}
        build = lambda: space.build(sample, **kwargs)  # noqa: E731
    run = FunctionRun(build, trainer, spec.get("hparams") or {}, stop_step=task.stop_step,
                      seed=int(spec.get("seed") or 0), checkpoint=task.checkpoint_in,
                      trial_id=task.trial_id)
    try:
        check_segment(run, task.start_step, task.stop_step, task.checkpoint_in)
    except Exception:
        run.close()
        raise
    return run
