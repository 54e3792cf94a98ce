"""The experiment: a space and a strategy become trained models, every fact in SQLite.

The engine owns the loop; the algorithms only return decisions. A :class:`~.trials.TrialRunner`
keeps every worker busy and applies the scheduler's decisions (training control); whenever a
slot is free and nothing waits to resume, it asks this experiment for a new trial, which asks
the strategy for a sample (instantiation control), instantiates it through the space (shapes
checked), skips structures already trained, and records the model before it is trained. When a
trial ends its final metric goes back to the strategy. The store journals everything before it
takes effect, so after a crash (even SIGKILL) ``resume()`` carries on: finished trials are
kept, running ones continue from their last checkpoint, the strategy and the scheduler continue
from their saved state.

Example::

    space = rt.ModelSpace(Net(), [...], example_input=torch.zeros(1, 1, 8, 8))
    exp = rt.Experiment(space, rt.strategies.RegularizedEvolution(32, 8),
                        rt.Trainer(dataset="digits", epochs=5), store="runs/exp.db", workers=2)
    exp.run(max_models=200)          # kill it any time; then exp.resume() or `retiarii resume`

Workers rebuild models from the sample (never a pickled model), so the space must be importable:
define it at module level of a file or package (in a script, guard the run with
``if __name__ == "__main__":``, as for any multiprocessing program).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import time
from typing import Any, Callable

from ..choices import ValueChoice
from ..refs import SCRIPT_MODULES, EncodeError, load_file_module, ref_of, resolve_ref, split_ref
from ..mutator import MutationError, SampleError
from ..shapes import ShapeMismatchError
from ..strategies.base import SpaceExhausted, sample_key
from ..strategies.scheduler import Scheduler
from .store import Store
from .trainer import ClassifierTrainer, Trainer
from .trials import Trial, TrialRunner, TrialState


_log = logging.getLogger("retiarii.engine")


class ExperimentError(RuntimeError):
    """An experiment that cannot start or resume as asked; the message says why and the fix."""


# ---- how workers find the space and the trainer ---------------------------------------------


def object_ref(obj: Any, what: str) -> str:
    """The reference (``"pkg.mod:name"``, or ``"/abs/file.py:name"`` for a script's object) by
    which a worker process finds ``obj``, checked now the way a worker will resolve it.

    ``obj`` may be the reference itself. Raises :class:`ExperimentError` naming the object and
    the fix when workers could not find it (not at module level, or bound only under the
    script's ``if __name__ == "__main__":``).
    """
    if isinstance(obj, str):
        ref = obj
        try:
            obj = resolve_ref(ref)
        except (ImportError, ValueError) as e:
            raise ExperimentError(f"the {what} reference {ref!r} does not resolve: {e}") from None
    else:
        try:
            ref = ref_of(obj)
        except EncodeError:
            raise ExperimentError(
                f"the {what} is not a module-level variable of an importable module or script, "
                f"so worker processes cannot rebuild it. Define it at module level (e.g. `space "
                f"= ModelSpace(...)` in myspace.py) or pass its reference as a string "
                f"('/abs/path/myspace.py:space')") from None
    _check_workers_see(ref, obj, what)
    return ref


def _check_workers_see(ref: str, obj: Any, what: str) -> None:
    """Refuse now a reference a new worker process would not resolve to the same object.

    A worker loads a script as a module, where its ``if __name__ == "__main__":`` block does
    not run; so a name bound (or rebound) there is not what the worker finds. Only the running
    script is in doubt: importable modules and files loaded as modules resolve in a worker as
    they do here.
    """
    where, attr, is_file = split_ref(ref)
    if not is_file or load_file_module(where).__name__ not in SCRIPT_MODULES:
        return
    fix = (f"Bind it at module level of {os.path.basename(where)}, outside the "
           f"`if __name__ == \"__main__\":` block (or in a module the script imports); "
           f"worker processes load the script as a module, where that block does not run")
    try:
        seen = resolve_ref(ref, fresh=True)
    except ImportError as e:
        raise ExperimentError(f"the {what} is `{attr}` of the script {where}, which worker "
                              f"processes cannot see: {e}. {fix}") from None
    except Exception as e:  # the script fails when loaded as a module
        raise ExperimentError(f"the {what} is `{attr}` of the script {where}, but loading the "
                              f"script as worker processes do fails ({type(e).__name__}: {e}). "
                              f"{fix}") from None
    if type(seen).__qualname__ != type(obj).__qualname__:
        raise ExperimentError(f"the {what} is `{attr}` of the script {where}, which worker "
                              f"processes see as a {type(seen).__name__}, not this "
                              f"{type(obj).__name__} (is it rebound under `if __name__ == "
                              f"\"__main__\":`?). {fix}")


def trainer_spec(trainer: Trainer) -> tuple[Any, dict[str, ValueChoice]]:
    """(what a worker rebuilds the trainer from, the trainer's ValueChoice hyper-parameters)."""
    if type(trainer) is ClassifierTrainer:
        config = dataclasses.asdict(trainer.config)
        choices = {k: v for k, v in config.items() if isinstance(v, ValueChoice)}
        config.update({k: v.default for k, v in choices.items()})
        try:
            json.dumps(config)
            return {"class": ref_of(ClassifierTrainer), "config": config}, choices
        except TypeError:
            pass  # (X, y) tensors as dataset: fall back to a reference to the object
        return object_ref(trainer, "trainer"), choices
    choices = {k: v for k, v in vars(trainer).items() if isinstance(v, ValueChoice)}
    return object_ref(trainer, "trainer"), choices


class _DrawnModels:
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


def _space_fingerprint(space) -> dict:
    return {"bases": [g.structural_hash() for g, _ in space.bases],
            "mutators": [[type(b.mutator).__name__, b.mutator.label] for b in space.mutators],
            "hparams": {k: v.values for k, v in space.hparams.items()}}


# ---- the experiment -----------------------------------------------------------------------


class Experiment:
    """Search ``space`` with ``strategy``, training each model with ``trainer``.

    Args:
        space: a :class:`~retiarii.ModelSpace` defined at module level (or its reference).
        strategy: instantiation control, e.g. ``rt.strategies.Random(seed=0)``.
        trainer: a :class:`~retiarii.Trainer`; its ValueChoice settings become choices.
        store: the SQLite file (created with its folder; checkpoints go next to it).
        workers: worker processes (one per GPU in ``devices``, else CPU shares).
        devices: GPU ids; None uses every visible GPU, [] forces CPU.
        max_models: stop proposing after this many distinct models.
        max_time: seconds; no new segment starts after it (running ones pause).
        seed: seeds the trials' weights and data order (trial i gets seed + i).
        scheduler: training control (``rt.strategies.ASHA(...)``...); default: train every
            model for the trainer's epochs.
        metric, mode: the reported metric the strategy optimizes, and its direction.
        max_failures: retries of a failing trial from its last checkpoint.
        dedup: do not train a structure (same structural hash and hyper-parameters) twice.
        executor: an :class:`~.executors.Executor` to use instead of local processes.
        progress: called with a summary dict after each finished trial (the CLI's display).
        origin: JSON kept with the experiment saying how it was made (the CLI's flags, so
            that ``retiarii resume`` can rebuild it); not compared on resume.
    """

    def __init__(self, space, strategy, trainer: Trainer, store: str = "runs/experiment.db",
                 workers: int = 2, devices=None, max_models: int | None = None,
                 max_time: float | None = None, seed: int = 0,
                 scheduler: Scheduler | None = None, metric: str = "val_acc", mode: str = "max",
                 max_failures: int = 3, dedup: bool = True, executor=None,
                 progress: Callable[[dict], None] | None = None, origin: dict | None = None):
        self.space_ref = object_ref(space, "space")
        self.space = space if not isinstance(space, str) else resolve_ref(space)
        self.strategy, self.trainer = strategy, trainer
        self.trainer_spec, hp = trainer_spec(trainer)
        hp = {k: v for k, v in hp.items() if k not in self.space.hparams}
        # The strategy searches the space plus the trainer's ValueChoices; workers rebuild from
        # the space itself, so those labels are kept out of the sample they get.
        self.search_space = self.space.with_hparams(hp)
        self._drawn = _DrawnModels(self.search_space)
        self._trainer_labels = {self.search_space.hparams[k].label for k in hp}
        self.path, self.workers, self.devices = str(store), workers, devices
        self.max_models, self.max_time, self.seed = max_models, max_time, seed
        self.scheduler = scheduler or Scheduler()
        self.metric, self.mode, self.max_failures, self.dedup = metric, mode, max_failures, dedup
        self.executor, self.progress, self.origin = executor, progress, origin
        self.store: Store | None = None
        self._known: dict[str, float | None] = {}  # dedup key -> final value (None: pending)
        self._keys: dict[int, str] = {}  # model id -> dedup key, until its trial ends
        self._count = 0  # models proposed so far (this experiment, resumes included)

    # ---- public ---------------------------------------------------------------------------
    def config(self) -> dict:
        """What a resume must match (budgets may change between runs)."""
        return {"space": {"ref": self.space_ref, **_space_fingerprint(self.search_space)},
                "strategy": {"class": ref_of(type(self.strategy)),
                             "config": self.strategy._config(), "seed": self.strategy.seed},
                "scheduler": {"class": ref_of(type(self.scheduler))},
                "trainer": self.trainer_spec, "seed": self.seed, "metric": self.metric,
                "mode": self.mode, "dedup": self.dedup}

    def run(self, max_models: int | None = None, max_time: float | None = None) -> dict:
        """Start a new experiment in the store and run it to the end; returns a summary."""
        self._budgets(max_models, max_time)
        self._open()
        self.store.add_experiment({**self.config(), "origin": self.origin}, self.seed,
                                  name=os.path.basename(self.path))
        return self._loop(resume=False)

    def resume(self, max_models: int | None = None, max_time: float | None = None) -> dict:
        """Continue the latest experiment of the store (after Ctrl-C, a crash or SIGKILL)."""
        self._budgets(max_models, max_time)
        self._open()
        experiments = self.store.experiments()
        if not experiments:
            raise ExperimentError(f"{self.path} holds no experiment to resume; use run()")
        saved = dict(self.store.use_experiment(experiments[-1]["id"])["config"])
        saved.pop("origin", None)
        mine = json.loads(json.dumps(self.config()))
        diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
        if diff:
            raise ExperimentError(
                f"cannot resume {self.path}: this experiment differs from the stored one in "
                f"{diff} (stored: { {k: saved.get(k) for k in diff} }). Resume with the same "
                f"space, strategy, trainer and seed, or run() a new experiment")
        state = self.store.load_strategy_state()
        if state is not None:
            self.strategy.load_state_dict(state)
        return self._loop(resume=True)

    # ---- the loop -----------------------------------------------------------------------------
    def _budgets(self, max_models, max_time):
        self.max_models = max_models if max_models is not None else self.max_models
        self.max_time = max_time if max_time is not None else self.max_time

    def _open(self):
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        self.store = Store(self.path)
        self.checkpoint_dir = os.path.splitext(os.path.abspath(self.path))[0] + ".checkpoints"

    def _loop(self, resume: bool) -> dict:
        store = self.store
        eid = store.experiment_id
        for row in store.models():
            if row["hash"]:
                key = self._dedup_key(row["hash"], row["sample"])
                self._known[key] = row.get("value")
                if row["status"] == "training":  # its trial resumes below
                    self._keys[row["id"]] = key
        self._count = len(store.models())
        executor = self.executor
        if executor is None:
            from .executors.local import LocalExecutor

            executor = LocalExecutor(self.workers, self.devices)
        epochs = getattr(self.trainer, "epochs", None)
        source = None if self.scheduler.spawns_trials else self._next_trial
        kwargs = dict(max_failures=self.max_failures, max_steps=epochs,
                      checkpoint_dir=self.checkpoint_dir, source=source,
                      on_result=self._on_result, on_trial_end=self._on_trial_end,
                      id_prefix=f"e{eid}-", spawn_config=self._spawn_config)
        self.runner = None
        started = time.monotonic()
        self._deadline = None if self.max_time is None else started + self.max_time
        store.set_experiment_status("running")
        try:
            if resume:
                runner = TrialRunner.resume(executor, self.scheduler, store, **kwargs)
            else:
                runner = TrialRunner(executor, self.scheduler, store, **kwargs)
            self.runner = runner
            runner.run()
            store.flush()
            done = not runner.budget_hit()
            store.set_experiment_status("done" if done else "stopped")
        except KeyboardInterrupt:
            store.set_experiment_status("interrupted")
            raise
        finally:
            if self.executor is None:
                executor.close()
            store.flush()
        return self.summary()

    def _dedup_key(self, structure_hash: str, sample: dict) -> str:
        hp = {k: sample.get(k) for k in sorted(self.search_space.hparams)}
        return hashlib.sha256(json.dumps([structure_hash, hp]).encode()).hexdigest()

    def _budget_left(self) -> bool:
        if self.max_models is not None and self._count >= self.max_models:
            return False
        return self._deadline is None or time.monotonic() < self._deadline

    def _next_trial(self, budgeted: bool = True) -> dict | None:
        """The runner's source: the strategy's next model as a trial config, or None."""
        duplicates = 0
        while not budgeted or self._budget_left():
            try:
                sample = self.strategy.ask(self._drawn)
            except SpaceExhausted:
                return None
            try:
                model = self._drawn.take(sample)
                if model is None:  # not drawn (a strategy that proposes without drawing)
                    model = self.search_space.instantiate(sample)
                else:
                    self.search_space.check_shapes(model)
            except (ShapeMismatchError, MutationError, SampleError) as e:
                self._count += 1  # a model that cannot be built fails alone, recorded
                _log.warning("model %s cannot be built, recorded as failed: %s", sample, e)
                self.store.add_model(sample, None, None, status="failed")
                self.strategy.tell(sample, None)
                self._save_strategy()
                continue
            structure = model.structural_hash()  # hashes every node: compute it once
            key = self._dedup_key(structure, sample)
            if self.dedup and key in self._known:
                duplicates += 1
                if duplicates > 1000:
                    return None  # the strategy keeps proposing trained structures
                if key in self._keys.values():
                    # In flight: its trial tells the strategy when it ends. (After a resume this
                    # is the strategy asking again for a model it proposed after its last saved
                    # state: the trial already exists and carries on.)
                    continue
                self.strategy.tell(sample, self._known[key])
                self._save_strategy()
                continue
            self._count += 1
            model_id = self.store.add_model(sample, model.graph.to_data(), structure,
                                            status="training")
            self._known[key] = None
            self._keys[model_id] = key
            config = {"space": self.space_ref, "trainer": self.trainer_spec,
                      "sample": {k: v for k, v in sample.items()
                                 if k not in self._trainer_labels},
                      "hparams": model.hparams, "seed": self.seed + self._count - 1,
                      "model_id": model_id, "choices": sample, "checked": True}
            # The strategy's state is saved when the trial ends, not here (it is the largest
            # write of a model): after a crash the strategy proposes this sample again from
            # its older state, and the in-flight check above lets the existing trial go on.
            return config
        return None

    def _spawn_config(self, spawn, parent: Trial | None) -> dict:
        """A scheduler's spawn (PBT) as a worker spec: a child keeps its parent's model and
        gets the spawn's hyper-parameters; a fresh trial takes a new model from the strategy."""
        if parent is not None:
            base = dict(parent.config)
        else:  # the population needs a model: the model budget does not apply to it
            base = self._next_trial(budgeted=False)
            if base is None:
                raise ExperimentError("the strategy has no model left for a new PBT trial")
        return {**base, "hparams": {**base.get("hparams", {}), **spawn.config}}

    def _collect_garbage(self, trial: Trial) -> None:
        """Delete the checkpoints the scheduler says nothing will read again (``trial``'s
        alone, unless the scheduler's trials share checkpoints)."""
        runner = getattr(self, "runner", None)
        if runner is None:  # still being rebuilt by TrialRunner.resume
            return
        if self.scheduler.checkpoints_shared:
            states = {t: s.value for t, s in runner.states().items()}
            checkpoints = runner.checkpoints()  # every trial's: list them once per trial end
        else:
            states = {trial.trial_id: trial.state.value}
            checkpoints = [(trial.trial_id, step, path)
                           for step, path in sorted(trial.checkpoints.items())]
        doomed = self.scheduler.deletable_checkpoints(checkpoints, states)
        for trial_id, step, path in checkpoints:
            if path in doomed:
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
                self.store.forget_checkpoint(trial_id, step)
                runner.trials[trial_id].checkpoints.pop(step, None)

    def _save_strategy(self) -> None:
        self.store.save_strategy_state(self.strategy.state_dict())

    def _on_result(self, trial: Trial, result: dict) -> None:
        sample = trial.config.get("choices")
        if sample is None:
            return
        try:
            self.strategy.on_step(sample, result["training_iteration"], result)
        except (KeyError, ValueError):
            # A trial resumed after a crash whose sample the restored strategy has not proposed
            # (again) yet: it learns the final value when it proposes it (see _next_trial).
            pass

    def _on_trial_end(self, trial: Trial) -> None:
        sample, model_id = trial.config.get("choices"), trial.config.get("model_id")
        value = (trial.last_result or {}).get(self.metric)
        failed = trial.state is TrialState.ERRORED or value is None
        if model_id is not None:
            self.store.set_model_status(model_id, "failed" if failed else "trained", value)
        if sample is not None:
            key = None
            if model_id is not None:
                # The key computed when it was proposed (saves reading the model's graph back);
                # a model of an earlier run (resume) takes its hash from the store.
                key = self._keys.pop(model_id, None)
                if key is None:
                    key = self._dedup_key(self.store.get_model(model_id)["hash"], sample)
            if key is not None:
                self._known[key] = value
            try:
                self.strategy.tell(sample, value)
            except (KeyError, ValueError):
                pass  # not proposed by the restored strategy (yet): told when it proposes it
            self._save_strategy()
        self._collect_garbage(trial)
        if self.progress is not None:
            self.progress(self.summary())

    def summary(self) -> dict:
        counts = self.store.counts_by_state()
        best = self.store.best_models(self.metric, self.mode, 5)
        return {"store": self.path, "models": self._count, "trials": counts, "best": best,
                "max_models": self.max_models}

