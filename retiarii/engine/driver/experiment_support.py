"""What the experiment checks and keeps beside its loop: its errors, the trainer's spec, the
models a strategy's draws built, and the fingerprints a resume compares (references checked the
way a worker resolves them: :mod:`..jobs.worker_refs`)."""
from __future__ import annotations

import collections
from typing import Any

from ...choices import ValueChoice
from ...moved import current_refs
from ...refs import ref_of
from ...sampler import sample_key
from ..errors import EnvironmentFailure, ExperimentError  # (executors raise them too)
from ..jobs.worker_refs import object_ref
from ..trainers.trainer import Trainer

__all__ = ["EnvironmentFailure", "ExperimentError", "DrawnModels", "comparable",
           "experiment_config", "object_ref", "recorded_config", "space_fingerprint",
           "trainer_notes", "trainer_spec"]


def trainer_spec(trainer: Trainer) -> tuple[Any, dict[str, ValueChoice]]:
    """(what a worker rebuilds the trainer from, the trainer's ValueChoice hyper-parameters)."""
    spec = trainer.to_spec()
    return (object_ref(trainer, "trainer") if spec is None else spec), trainer.value_choices()


def trainer_notes(trainer: Any, metric: str) -> dict:
    """What an experiment keeps about its trainer's data, beside its config (resume does not
    compare it): ``preprocessing``, the trainer's words for how raw data becomes model inputs
    (``retiarii export`` writes them into each model file), and ``chance``, ``metric`` at
    chance on the validation data (``retiarii status`` flags a one-shot selection no better).
    A trainer that cannot say (a custom one, settings that are still choices) leaves None."""
    notes: dict = {}
    for key, ask in (("preprocessing", lambda: trainer.preprocessing()),
                     ("chance", lambda: trainer.chance_level(metric))):
        try:
            notes[key] = ask()
        except Exception:  # noqa: BLE001 (a description must never stop a run: it stays unknown)
            notes[key] = None
    return notes


def experiment_config(exp: Any) -> dict:
    """What a resume of experiment ``exp`` must match (budgets may change between runs).
    Deterministic mode is kept when on (other kernels, other numbers: a run is resumed only in
    the mode it started in); left out when off, as stores before it."""
    determinism = {"deterministic": True} if exp.deterministic else {}
    space = {"ref": exp.space_ref, **space_fingerprint(exp.search_space)}
    if exp.one_shot:
        from .one_shot_host import one_shot_spec

        config = {"space": space, "strategy": one_shot_spec(exp.strategy),
                  "trainer": exp.trainer_spec, "seed": exp.seed, "metric": exp.metric,
                  "mode": exp.mode}
        if exp.ranks > 1:  # other ranks, other samples per step: another search
            config["ranks"] = exp.ranks
        if exp.device_memory is not None:  # another split, other models per rank
            config["device_memory"] = exp.device_memory
        return {**config, **determinism}
    return {"space": space,
            "strategy": {"class": ref_of(type(exp.strategy)), "config": exp.strategy.config(),
                         "seed": getattr(exp.strategy, "seed", None)},
            "scheduler": {"class": ref_of(type(exp.scheduler))},
            "trainer": exp.trainer_spec, "seed": exp.seed, "metric": exp.metric,
            "mode": exp.mode, "dedup": exp.dedup, **determinism,
            # left out for one metric: stores from before several objectives still resume
            **({"objectives": exp.objectives.to_json()} if exp.objectives.extended else {}),
            **({"costs": sorted(exp.costs)} if exp.costs else {})}


def recorded_config(exp: Any) -> dict:
    """What an experiment's row keeps: its ``config()``, its ``origin`` and its
    :func:`trainer_notes`."""
    return {**exp.config(), "origin": exp.origin, **trainer_notes(exp.trainer, exp.metric)}


class DrawnModels:
    """The search space as the strategy sees it, keeping the models its draws built during one
    proposal (TPE draws 24 candidates) so that instantiating the sample it settles on does not
    build that model a second time."""

    def __init__(self, space, keep: int = 32):
        self._space, self._keep = space, keep
        self._models: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def sample(self, sampler):
        model = self._space.sample(sampler)
        self._models[sample_key(model.sample)] = model
        while len(self._models) > self._keep:
            self._models.popitem(last=False)
        return model

    def take(self, sample: dict):
        """The model a draw built for ``sample``, or None; the other draws are forgotten (the
        strategy has settled)."""
        model = self._models.pop(sample_key(sample), None)
        self._models.clear()
        return model

    def __getattr__(self, name):  # size(), enumerate(), hparams, ...: the space's own
        return getattr(self._space, name)


def space_fingerprint(space) -> dict:
    out = {"bases": [g.structural_hash() for g, _ in space.bases],
           "mutators": [[type(b.mutator).__name__, b.mutator.label] for b in space.mutators],
           "hparams": {k: v.values for k, v in space.hparams.items()}}
    labels = {k: label for k, label in space.hparam_labels().items() if label != k}
    if labels:  # a setting whose choice is labelled otherwise (batch_size: "bs"): its samples
        out["hparam_labels"] = labels  # hold it under that label (retrain rebuilds the choice)
    frozen = space.frozen_fingerprint()
    if frozen is not None:  # only spaces with frozen values: older stores still resume
        out["frozen"] = frozen
    return out


def comparable(config: dict) -> dict:
    """An experiment's config as resume compares it: where the space and trainer files lie is
    left out (a run directory may be moved or copied with its space file); what they define
    is compared (the space's fingerprint, the trainer's settings). References to modules that
    have moved since the config was saved are read at their new names (:mod:`retiarii.moved`)."""
    config = current_refs(config)
    config.pop("origin", None)
    for note in ("preprocessing", "chance"):  # descriptions of the data (trainer_notes)
        config.pop(note, None)
    if isinstance(config.get("space"), dict):
        # hparam_labels: recorded since the labels' fix, so a store of an older version, which
        # lacks them, still resumes (the labels of the samples it holds are its own)
        config["space"] = {k: v for k, v in config["space"].items()
                           if k not in ("ref", "hparam_labels")}
    if isinstance(config.get("trainer"), str):  # a reference: its file may have moved
        config["trainer"] = config["trainer"].rsplit(":", 1)[-1]
    trainer = config.get("trainer")
    if isinstance(trainer, dict) and isinstance((trainer.get("config") or {}).get("train"), str):
        # a FunctionTrainer's function, by reference: its file may have moved too
        train = trainer["config"]["train"].rsplit(":", 1)[-1]
        config["trainer"] = {**trainer, "config": {**trainer["config"], "train": train}}
    return config
