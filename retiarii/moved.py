"""Old import paths of moved modules, kept working: one table, old dotted name -> new one.

The engine and the strategies were split into folders by role (docs/architecture.md). Stores
written before hold import references to the old paths (``"retiarii.strategies.evolution:
RegularizedEvolution"`` in an experiment's config), pickles name classes by their old modules,
and users' scripts import documented paths. Instead of a shim file at every old path, one
meta-path finder (installed when ``retiarii/__init__.py`` imports this module, before anything
else of the package) answers an old name with the module at its new name: the very same module object, so
``retiarii.engine.trials.TrialRunner is retiarii.engine.runner.trial_runner.TrialRunner`` and a
``monkeypatch`` of either name patches both.

Example::

    import retiarii.engine.trials as trials           # the module retiarii.engine.runner.trial_runner
    current_ref("retiarii.strategies.evolution:RegularizedEvolution")
    # -> "retiarii.strategies.multi_trial.evolution:RegularizedEvolution"

Code of the package imports the new names only (tests/test_moved.py checks it). A name leaves
the table only when no store or script of a supported version can still hold it.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import Any

__all__ = ["MOVED", "MOVED_NAMES", "current_name", "current_ref", "current_refs", "install",
           "package_getattr"]

# old dotted module name -> new dotted module name (``retiarii.`` left out)
_TABLE = {
    "engine.checkpoint": "engine.storage.checkpoint",
    "engine.clock": "engine.worker_side.compute_clock",
    "engine.costs": "engine.driver.costs",
    "engine.data": "engine.trainers.data",
    "engine.dedicated": "engine.worker_side.dedicated_group",
    "engine.executors.base": "engine.jobs.job",
    "engine.experiment": "engine.driver.experiment",
    "engine.experiment_checks": "engine.driver.experiment_checks",
    "engine.experiment_support": "engine.driver.experiment_support",
    "engine.failures": "engine.driver.failures",
    "engine.flights": "engine.runner.flights",
    "engine.function_run": "engine.trainers.function_run",
    "engine.function_trainer": "engine.trainers.function_trainer",
    "engine.fused": "engine.worker_side.fused_group",
    "engine.grouped": "engine.worker_side.training_group",
    "engine.grouping": "engine.runner.planner",
    "engine.image_trainer": "engine.trainers.image_trainer",
    "engine.job_contract": "engine.jobs.contract",
    "engine.journal": "engine.runner.journal",
    "engine.layout_model": "engine.worker_side.auto_layout",
    "engine.layouts": "engine.worker_side.group_layouts",
    "engine.lock": "engine.storage.lock",
    "engine.measuring": "engine.worker_side.measuring_group",
    "engine.one_shot": "engine.driver.one_shot_host",
    "engine.one_shot_worker": "engine.worker_side.one_shot_segment",
    "engine.op_latency": "engine.driver.op_latency",
    "engine.pareto": "engine.storage.pareto",
    "engine.placing": "engine.runner.packer",
    "engine.plans": "engine.storage.plans_table",
    "engine.proposals": "engine.driver.proposals",
    "engine.segments": "engine.storage.segments_table",
    "engine.selection_notes": "engine.storage.selection_notes",
    "engine.state_store": "engine.storage.state_tables",
    "engine.store": "engine.storage.store",
    "engine.store_queries": "engine.storage.queries",
    "engine.store_schema": "engine.storage.schema",
    "engine.trainer": "engine.trainers.trainer",
    "engine.trial": "engine.runner.trial",
    "engine.trial_events": "engine.runner.job_events",
    "engine.trial_run": "engine.trainers.trial_training",
    "engine.trials": "engine.runner.trial_runner",
    "engine.worker": "engine.worker_side.worker",
    "strategies._relaxed": "strategies.one_shot.relaxed_training",
    "strategies.asha": "strategies.schedulers.asha",
    "strategies.base": "strategies.multi_trial.base",
    "strategies.darts": "strategies.one_shot.darts",
    "strategies.enas": "strategies.one_shot.enas",
    "strategies.evolution": "strategies.multi_trial.evolution",
    "strategies.fixed": "strategies.multi_trial.fixed",
    "strategies.grid": "strategies.multi_trial.grid",
    "strategies.hyperband": "strategies.schedulers.hyperband",
    "strategies.hypertrick": "strategies.schedulers.hypertrick",
    "strategies.median_stopping": "strategies.schedulers.median_stopping",
    "strategies.moasha": "strategies.schedulers.moasha",
    "strategies.pbt": "strategies.schedulers.pbt",
    "strategies.predictor": "strategies.multi_trial.predictor",
    "strategies.progressive": "strategies.multi_trial.progressive",
    "strategies.proxyless": "strategies.one_shot.proxyless",
    "strategies.random_search": "strategies.multi_trial.random_search",
    "strategies.rl": "strategies.multi_trial.rl",
    "strategies.scalarized": "strategies.schedulers.scalarized",
    "strategies.scheduler": "strategies.schedulers.base",
    "strategies.shared_training": "strategies.one_shot.shared_training",
    "strategies.snas": "strategies.one_shot.snas",
    "strategies.split_training": "strategies.one_shot.split_training",
    "strategies.spos": "strategies.one_shot.spos",
    "strategies.tpe": "strategies.multi_trial.tpe",
    "strategies.weight_sharing": "strategies.one_shot.weight_sharing",
}
MOVED: dict[str, str] = {f"retiarii.{old}": f"retiarii.{new}" for old, new in _TABLE.items()}

# Names that moved out of a module that stays: old dotted name of the name -> the module that
# holds it now (``retiarii.`` left out). The launcher of ranks went from optim to the executors;
# optim cannot import it back (the launcher imports what runs on each rank from optim: a
# circle), so the module that lost it answers its old name lazily (:func:`package_getattr`).
_NAMES = {
    **{f"optim.{name}": "engine.executors.local_ranks"
       for name in ("RankError", "run_segment_on_ranks", "spawn")},
    **{f"optim.mixed_parallel.{name}": "engine.executors.local_ranks"
       for name in ("DEFAULT_TIMEOUT", "RankError", "loopback_interface",
                    "run_segment_on_ranks", "spawn")},
}
MOVED_NAMES: dict[str, str] = {f"retiarii.{old}": f"retiarii.{new}" for old, new in _NAMES.items()}


def current_name(module: str) -> str:
    """The module's name today: its new name if it moved, else itself."""
    return MOVED.get(module, module)


def current_ref(ref: str) -> str:
    """An import reference (``"module:attr"``) with its module's name of today; anything else
    (a file reference, a reference that never moved) comes back as it was."""
    where, colon, attr = ref.rpartition(":")
    holder = MOVED_NAMES.get(f"{where}.{attr.partition('.')[0]}") if colon else None
    if holder is not None:  # a name that left its module: the module that holds it now
        return f"{holder}:{attr}"
    if colon and where in MOVED:
        return f"{MOVED[where]}:{attr}"
    return ref


def current_refs(value: Any) -> Any:
    """``value`` (JSON: dicts, lists, strings) with every import reference to a moved module
    written with its new name: how a config saved before the moves compares with today's."""
    if isinstance(value, str):
        return current_ref(value)
    if isinstance(value, list):
        return [current_refs(v) for v in value]
    if isinstance(value, dict):
        return {k: current_refs(v) for k, v in value.items()}
    return value


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new name (importing that one as usual)."""

    def __init__(self, new: str):
        self.new = new
        self._spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # the import system has just set the alias's spec on the module: the module keeps its
        # own (its name, file and loader), or pickling and reloading would see the old name
        module.__spec__ = self._spec


class _Finder(importlib.abc.MetaPathFinder):
    """The meta-path finder of the old names in :data:`MOVED` (and only of them)."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


_FINDER = _Finder()


def package_getattr(package: str):
    """A module ``__getattr__`` (PEP 562) for ``package`` that answers an old submodule name
    with its moved module, so ``rt.engine.experiment.ExperimentError`` keeps working as an
    attribute, as it did when the package imported that submodule itself, and a name that
    moved out of it (:data:`MOVED_NAMES`) with that name in its new module, imported on first
    use. A package (or module) calls it once: ``__getattr__ = package_getattr(__name__)``."""
    def moved_attribute(name: str):
        holder = MOVED_NAMES.get(f"{package}.{name}")
        if holder is not None:
            return getattr(importlib.import_module(holder), name)
        new = MOVED.get(f"{package}.{name}")
        if new is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return importlib.import_module(new)
    return moved_attribute


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once): an old name never reaches the file
    system, so a stale file left at an old path cannot shadow the moved module."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


install()
