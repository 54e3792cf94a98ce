"""The one registry of names: strategies, one-shot strategies, schedulers and executors.

``retiarii run --strategy NAME``, ``retiarii nas`` and ``Experiment(space, "NAME", ...)`` all
resolve names here, so a name means the same class with the same settings everywhere. Classes
are imported on first use (``"ray"`` does not import Ray until asked for). A name not found is
refused with the valid ones and, for a near miss, "did you mean":

    >>> from retiarii import registry
    >>> registry.strategy_class("evolution").__name__
    'RegularizedEvolution'
    >>> registry.make_strategy("evolutoin")
    Traceback (most recent call last):
    ...
    retiarii.registry.UnknownName: unknown strategy 'evolutoin' (did you mean 'evolution'?); ...

A class name (``"RegularizedEvolution"``) is accepted wherever a registry name is: ``retiarii
nas`` rows name the class their paper's strategy runs with.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from typing import Any

__all__ = ["Entry", "UnknownName", "EXECUTORS", "MULTI_TRIAL", "ONE_SHOT", "SCHEDULERS",
           "did_you_mean", "entry", "is_one_shot", "make_executor", "make_scheduler",
           "make_strategy", "names", "strategy_class", "strategy_names"]


class UnknownName(ValueError):
    """A name the registry does not hold; the message names the valid ones."""

    def __init__(self, kind: str, name: Any, valid: tuple[str, ...]):
        self.kind, self.name, self.valid = kind, name, valid
        super().__init__(f"unknown {kind} {name!r}{did_you_mean(name, valid)}; valid: "
                         f"{', '.join(valid)}")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One name of the registry."""

    name: str  # what users type: --strategy NAME, Experiment(space, "NAME", ...)
    target: str  # "module:Class", imported on first use
    # keyword arguments the name builds with, as (key, value) pairs: the CLI's settings,
    # chosen for the small searches a name without arguments is used for
    defaults: tuple = ()

    @property
    def class_name(self) -> str:
        return self.target.rsplit(":", 1)[1]

    def load(self) -> type:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


def _table(*entries: Entry) -> dict[str, Entry]:
    return {e.name: e for e in entries}


_M, _O, _H = ("retiarii.strategies.multi_trial.", "retiarii.strategies.one_shot.",
               "retiarii.strategies.schedulers.")
MULTI_TRIAL = _table(
    Entry("random", _M + "random_search:Random"),
    Entry("grid", _M + "grid:GridSearch"),
    # 16 and 4: a population a 30-model default budget leaves (the paper's 100/25 need
    # thousands of models)
    Entry("evolution", _M + "evolution:RegularizedEvolution",
          (("population_size", 16), ("sample_size", 4))),
    Entry("rl", _M + "rl:PolicyBasedRL"),
    # Cai et al.'s tree-LSTM meta-controller over model_spaces/path_level.py's transformations
    Entry("path_level_rl", _M + "path_level_rl:PathLevelRL"),
    # Liu et al.'s mutation over model_spaces/hierarchical.py's motifs (level 2) and cell (3)
    Entry("hierarchical_evolution", _M + "hierarchical_evolution:HierarchicalEvolution",
          (("population_size", 16), ("sample_size", 4),
           ("levels", {**{f"motif{m}": 2 for m in range(1, 7)}, "cell": 3}))),
    # the minimal network first; WANN's ranking needs WANNTrainer's three metrics
    Entry("wann", _M + "wann:WANN", (("population_size", 16), ("sample_size", 4))),
    Entry("tpe", _M + "tpe:TPE"),
    Entry("predictor", _M + "predictor:Predictor"),
    # Dai et al.'s Gaussian process and genetic search; no latency table: unconstrained
    Entry("chamnet", _M + "chamnet:ChamNet"),
    Entry("progressive", _M + "progressive:Progressive"),
    # a GCN over NAS-Bench-101's cells (the paper's); small rounds for the CLI's budgets
    Entry("neural_predictor", _M + "neural_predictor:NeuralPredictor",
          (("graph", "model_spaces.nasbench101:cell_graph"),
           ("types", ("input", "conv3x3-bn-relu", "conv1x1-bn-relu", "maxpool3x3", "output")),
           ("n_train", 10), ("n_candidates", 200), ("top_k", 5), ("epochs", 100))),
)
ONE_SHOT = _table(
    Entry("darts", _O + "darts:DARTS"),
    Entry("gumbel", _O + "snas:GumbelDARTS"),
    Entry("proxyless", _O + "proxyless:ProxylessNAS"),
    Entry("spos", _O + "spos:SPOS"),
    Entry("fairnas", _O + "fairnas:FairNAS"),
    Entry("single_path", _O + "single_path:SinglePathNAS"),
    Entry("ofa", _O + "once_for_all:OnceForAll"),
    Entry("enas", _O + "enas:ENAS"),
)
SCHEDULERS = _table(
    # halving by 2 from one epoch: rungs a 5-epoch default trainer still has
    Entry("asha", _H + "asha:ASHA", (("grace_period", 1), ("reduction_factor", 2))),
    Entry("median", _H + "median_stopping:MedianStopping",
          (("grace_period", 1), ("min_samples_required", 3))),
    # several objectives (--metric a,b): promotion by non-dominated rank, ASHA's rungs
    Entry("moasha", _H + "moasha:MOASHA", (("grace_period", 1), ("reduction_factor", 2))),
)
EXECUTORS = _table(
    Entry("local", "retiarii.engine.executors.local:LocalExecutor"),
    Entry("ray", "retiarii.engine.executors.ray:RayExecutor"),  # Ray imported only when asked
)
_KINDS = {"strategy": {**MULTI_TRIAL, **ONE_SHOT}, "multi-trial strategy": MULTI_TRIAL,
          "one-shot strategy": ONE_SHOT, "scheduler": SCHEDULERS, "executor": EXECUTORS}
# What each one-shot strategy calls its number of segments (an epoch of the super-network each)
_SEGMENTS = ("epochs", "train_segments", "segments")


def did_you_mean(name: Any, valid) -> str:
    """`` (did you mean 'x'?)`` for a near miss of ``name`` among ``valid``, else ``""``."""
    if not isinstance(name, str):
        return ""
    lower = {v.lower(): v for v in valid}
    close = difflib.get_close_matches(name.lower(), list(lower), n=1, cutoff=0.6)
    return f" (did you mean {lower[close[0]]!r}?)" if close else ""


def names(kind: str) -> tuple[str, ...]:
    """The names of ``kind``: ``"strategy"`` (multi-trial and one-shot), ``"multi-trial
    strategy"``, ``"one-shot strategy"``, ``"scheduler"`` or ``"executor"``."""
    return tuple(_KINDS[kind])


def strategy_names() -> tuple[str, ...]:
    """Every strategy name, multi-trial first."""
    return names("strategy")


def entry(kind: str, name: Any) -> Entry:
    """The entry ``name`` (a registry name or its class name, any case) of ``kind``.

    Raises:
        UnknownName: ``name`` is neither; the message names the valid names.
    """
    table = _KINDS[kind]
    if isinstance(name, str):
        key = name.strip().lower()
        for e in table.values():
            if key in (e.name, e.class_name.lower()):
                return e
    raise UnknownName(kind, name, tuple(table))


def strategy_class(name: str) -> type:
    """The class of strategy ``name`` (multi-trial or one-shot)."""
    return entry("strategy", name).load()


def is_one_shot(name: str) -> bool:
    """Whether strategy ``name`` is one-shot (weight-sharing)."""
    return entry("strategy", name).name in ONE_SHOT


def make_strategy(name: str, seed: int = 0, segments: int | None = None, **options: Any):
    """Strategy ``name`` with the registry's settings, ``seed`` and ``options`` over them.

    Args:
        seed: seeds the search.
        segments: a one-shot strategy's segments (default 5); refused for the others.
        options: keyword arguments of the class that replace the registry's.
    """
    e = entry("strategy", name)
    cls = e.load()
    params = inspect.signature(cls).parameters
    kwargs: dict[str, Any] = dict(e.defaults)
    if e.name in ONE_SHOT:
        key = next((p for p in _SEGMENTS if p in params), None)
        if key is not None:
            kwargs[key] = 5 if segments is None else segments
        elif segments is not None:
            raise ValueError(f"{cls.__name__} takes no number of segments; leave it out")
    elif segments is not None:
        raise ValueError(f"segments={segments}: {cls.__name__} is multi-trial; its models train "
                         f"for the trainer's epochs")
    if "seed" in params:
        kwargs["seed"] = seed
    return cls(**{**kwargs, **options})


def make_scheduler(name: str, metric: str = "val_acc", mode: str = "max",
                   max_t: int | None = None):
    """Scheduler ``name`` (``"none"`` or None: None, every trial trains to the end) on
    ``metric``; ``max_t``: the trainer's epochs, for schedulers that take a horizon."""
    if name is None or name == "none":
        return None
    e = entry("scheduler", name)
    cls = e.load()
    kwargs: dict[str, Any] = {"metric": metric, "mode": mode, **dict(e.defaults)}
    if "max_t" in inspect.signature(cls).parameters and max_t is not None:
        kwargs["max_t"] = max_t
    return cls(**kwargs)


def make_executor(name: str, workers: int, devices=None, *, one_shot: bool = False,
                  ranks: int = 1, **options: Any):
    """Executor ``name`` with ``workers`` slots (a one-shot search: one slot, ``ranks`` per
    segment); ``options`` go to its constructor (``address=``, ``runtime_env=`` for Ray)."""
    return entry("executor", name).load().for_search(workers, devices, one_shot=one_shot,
                                                     ranks=ranks, **options)
