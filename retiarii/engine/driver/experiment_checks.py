"""What ``Experiment(...)`` checks before it keeps anything: every argument, names resolved.

An experiment is refused at construction, before any store, lock file or folder exists, when
an argument cannot work: a strategy, scheduler or executor named by a name the registry
(:mod:`retiarii.registry`) lacks (refused with the valid names and "did you mean" for a near
miss), an object that is not one, a budget that is not a positive number. Checks that need the
space or the strategy's kind (one-shot options) stay in :class:`~.experiment.Experiment`.
"""
from __future__ import annotations

import numbers
import os
import warnings
from typing import Any

from ... import registry
from ...choices import Expr
from ...optim.config import OptimizeConfig
from ...strategies.multi_trial.base import Strategy
from ...strategies.one_shot.base import OneShot
from ...strategies.schedulers.base import Scheduler
from ..jobs.job import Executor
from .experiment_support import ExperimentError
from ..trainers.trainer import Trainer

__all__ = ["BudgetWarning", "budget_warning", "warn_budget", "check_arguments", "check_costs",
           "check_ranks", "optimize_config",
           "resolve_strategy",
           "resolve_scheduler"]


def resolve_strategy(strategy: Any, seed: int) -> Any:
    """``strategy`` as an object: a name is built by the registry (with ``seed``), an object
    must be a :class:`~retiarii.strategies.Strategy` or a one-shot strategy."""
    if isinstance(strategy, str):
        try:
            return registry.make_strategy(strategy, seed=seed)
        except registry.UnknownName as err:
            raise ExperimentError(f"strategy={strategy!r}: {err}") from None
    if isinstance(strategy, type) and issubclass(strategy, (Strategy, OneShot)):
        raise ExperimentError(f"strategy={strategy.__name__}: give an instance "
                              f"({strategy.__name__}(...)), not the class")
    if not isinstance(strategy, (Strategy, OneShot)):
        raise ExperimentError(
            f"strategy={strategy!r} is not a strategy: give one of rt.strategies (e.g. "
            f"rt.strategies.Random(seed=0)) or a name: {', '.join(registry.strategy_names())}")
    return strategy


def resolve_scheduler(scheduler: Any, objectives: Any, epochs: Any) -> Any:
    """``scheduler`` as an object or None: a name (``"asha"``, ``"median"``, ``"none"``) is
    built by the registry on the objective (``"moasha"``: the objectives) with the trainer's
    ``epochs`` as its horizon; a scheduler of one metric is refused for several."""
    if isinstance(scheduler, str):
        several = objectives.multi
        if several and scheduler not in ("moasha", "none"):
            raise ExperimentError(f"scheduler={scheduler!r} ranks one metric; with several "
                                  f"objectives use 'moasha' (promotion by non-dominated rank) "
                                  f"or rt.strategies.Scalarized(...) over a stated "
                                  f"scalarization")
        metric, mode = ((list(objectives.metrics), [str(m) for m in objectives.modes])
                        if several else (objectives.metrics[0], objectives.modes[0]))
        try:
            return registry.make_scheduler(scheduler, metric, mode,
                                           epochs if isinstance(epochs, int) else None)
        except registry.UnknownName as err:
            raise ExperimentError(f"scheduler={scheduler!r}: {err} (or 'none')") from None
        except ValueError as err:  # moasha with one metric
            raise ExperimentError(f"scheduler={scheduler!r}: {err}") from None
    if scheduler is not None and not isinstance(scheduler, Scheduler):
        raise ExperimentError(f"scheduler={scheduler!r} is not a scheduler: give one of "
                              f"rt.strategies (ASHA, MedianStopping, PBT...), a name "
                              f"({', '.join(registry.names('scheduler'))}) or None")
    return scheduler


def _count(name: str, value: Any, least: int, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ExperimentError(f"{name}={value!r}: give a whole number >= {least}"
                              + (" (or None: no limit)" if none_ok else ""))


def check_arguments(*, trainer, store, workers, devices, max_models, max_time, seed, metric,
                    max_failures, model_retries, dedup, executor, progress, origin) -> None:
    """Refuse any argument that cannot work, naming it and what to give instead."""
    if not isinstance(trainer, Trainer):
        raise ExperimentError(f"trainer={trainer!r} is not a Trainer: give rt.Trainer(...) or "
                              f"a subclass of retiarii.Trainer")
    epochs = getattr(trainer, "epochs", None)
    if isinstance(epochs, Expr):  # the runner, schedulers and resume count steps against it
        values = [v for v in getattr(epochs, "values", []) if isinstance(v, int)]
        raise ExperimentError(
            f"{type(trainer).__name__}(epochs={epochs!r}): a trial's length is one number for "
            f"the whole search (trials, schedulers and resume count their steps against it), "
            f"not a choice; give the longest, e.g. epochs={max(values) if values else 'N'}, "
            f"and let a scheduler stop the weaker models early "
            f"(scheduler=rt.strategies.ASHA(...) or Hyperband(...))")
    if not isinstance(store, (str, os.PathLike)) or not str(store):
        raise ExperimentError(f"store={store!r}: give the path of a SQLite file, e.g. "
                              f"'runs/exp.db'")
    if os.path.isdir(store):
        raise ExperimentError(f"store={str(store)!r} is a folder: give the path of a SQLite "
                              f"file in it, e.g. {os.path.join(str(store), 'exp.db')!r}")
    _count("workers", workers, 1)
    _count("max_models", max_models, 1, none_ok=True)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ExperimentError(f"seed={seed!r}: give a whole number")
    _count("max_failures", max_failures, 0)
    _count("model_retries", model_retries, 0)
    if max_time is not None and (isinstance(max_time, bool) or not isinstance(
            max_time, numbers.Real) or not max_time > 0):
        raise ExperimentError(f"max_time={max_time!r}: give seconds > 0 (or None: no limit)")
    if devices is not None and (isinstance(devices, (str, int)) or not all(
            isinstance(d, (str, int)) for d in devices)):
        raise ExperimentError(f"devices={devices!r}: give a list of GPU ids ([0, 1]), [] for "
                              f"the CPU, or None for every visible GPU")
    if not isinstance(metric, str) or not metric:
        raise ExperimentError(f"metric={metric!r}: give the name of a metric the trainer "
                              f"reports, e.g. 'val_acc'")
    if not isinstance(dedup, bool):
        raise ExperimentError(f"dedup={dedup!r}: give True or False")
    if isinstance(executor, str):
        try:
            registry.entry("executor", executor)
        except registry.UnknownName as err:
            raise ExperimentError(f"executor={executor!r}: {err}; or give an Executor") from None
    elif executor is not None and not isinstance(executor, Executor):
        raise ExperimentError(f"executor={executor!r} is not an Executor: give "
                              f"{' or '.join(map(repr, registry.names('executor')))} or an "
                              f"Executor object")
    if progress is not None and not callable(progress):
        raise ExperimentError(f"progress={progress!r}: give a function of the summary dict")
    if origin is not None and not isinstance(origin, dict):
        raise ExperimentError(f"origin={origin!r}: give a JSON dict (or None)")


def check_costs(costs: Any) -> dict:
    """The user's own costs as a dict name -> function, none named as an engine's cost."""
    if costs is not None and (not isinstance(costs, dict) or not all(
            isinstance(k, str) and callable(f) for k, f in costs.items())):
        raise ExperimentError(f"costs={costs!r}: give a dict name -> function of the "
                              f"built module returning a number")
    from .costs import COSTS

    clash = sorted(set(costs or {}) & set(COSTS))
    if clash:
        raise ExperimentError(f"costs={{{clash[0]!r}: ...}}: {clash[0]} is measured by the "
                              f"engine; give your cost another name")
    return dict(costs or {})


def check_ranks(ranks: Any, strategy: Any, one_shot: bool) -> int:
    """Ranks of a one-shot segment: a whole number >= 1, above 1 only for one-shot searches."""
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ExperimentError(f"ranks={ranks!r}: give a number of ranks >= 1")
    if ranks > 1 and not one_shot:
        raise ExperimentError(f"ranks={ranks} runs a one-shot segment on several ranks; "
                              f"{type(strategy).__name__} is multi-trial: use workers= to "
                              f"train its models in parallel, or weight_sharing=True")
    return ranks


class BudgetWarning(UserWarning):
    """A budget the search spends before its strategy learns anything: a random search."""


def startup_need(strategy, workers: int, in_job: int) -> int | None:
    """How many models ``strategy`` draws before it learns from a result: the larger of its
    random start-up (its population, its random trials) and the ``workers`` x ``in_job``
    models proposed before any result comes back; None for a strategy without a start-up
    (grid, random, one-shot)."""
    startup = getattr(strategy, "random_startup", lambda: None)()
    return None if startup is None else max(startup[0], workers * in_job)


def budget_warning(strategy, max_models: int | None, workers: int, in_job: int) -> str | None:
    """What to warn when ``max_models`` does not pass ``strategy``'s random start-up (its
    population, its random start-up trials) or the first batch of models proposed before any
    result comes back (``workers`` x ``in_job`` models a job trains), else None."""
    need = startup_need(strategy, workers, in_job)
    if need is None or max_models is None or max_models > need:
        return None
    own, why = strategy.random_startup()
    first = workers * in_job
    parts = [f"{why} random models" if own else None,
             f"{first} models proposed before the first result ({workers} workers x {in_job} "
             f"per job)" if first >= own else None]
    reasons = " and ".join(p for p in parts if p)
    return (f"max_models={max_models} does not pass the start-up of "
            f"{type(strategy).__name__} ({reasons}): every model is drawn before it learns "
            f"from a result, a random search. Give max_models > {need}, or lower its start-up")


def warn_budget(strategy, max_models: int | None, workers: int, in_job: int) -> None:
    """Warn once, at the start of a search, when :func:`budget_warning` has something to say."""
    why = budget_warning(strategy, max_models, workers, in_job)
    if why:
        warnings.warn(why, BudgetWarning, stacklevel=3)


def optimize_config(optimize: Any, **given: Any) -> OptimizeConfig:
    """The experiment's :class:`OptimizeConfig`: ``optimize`` itself, or one made of the
    keyword arguments; a bad value raises :class:`ExperimentError` naming it."""
    defaults = {"batch_models": 8, "packing": "auto"}
    if isinstance(optimize, OptimizeConfig):
        clash = [k for k, v in given.items() if v != defaults.get(k)]
        if clash:
            raise ExperimentError(f"optimize= is an OptimizeConfig: give {', '.join(clash)} "
                                  f"inside it (OptimizeConfig({clash[0]}=...)), not beside it")
        return optimize
    passes = dict(given.pop("passes") or {})
    batching = given.pop("batching")
    if batching is not None:
        if "batching" in passes and passes["batching"] != batching:
            raise ExperimentError(f"batching={batching!r} and passes={passes!r} disagree: "
                                  f"give it once")
        passes["batching"] = batching
    for name, value in passes.items():
        if value is None:
            raise ExperimentError(f"{name}=None: give 'auto', True or False (or leave it out: "
                                  f"'auto' under optimize='auto', else False)")
    if given["dedicated"] is None:
        given["dedicated"] = ()
    try:
        return OptimizeConfig(mode=optimize, passes=passes, **given)
    except (ValueError, TypeError) as err:
        raise ExperimentError(str(err)) from None
