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
import hashlib
import json
import logging
import os
import time
from typing import Any, Callable

from ..choices import ValueChoice
from ..enums import Mode, ModelStatus
from ..mutator import MutationError
from ..refs import SCRIPT_MODULES, EncodeError, load_file_module, ref_of, resolve_ref, split_ref
from ..sampler import SampleError, sample_key
from ..shapes import ShapeMismatchError
from ..strategies.base import SpaceExhausted, UnknownSample
from ..strategies.one_shot import OneShot
from ..strategies.scheduler import Scheduler
from ..threads import one_thread
from .checkpoint import CheckpointDir, CheckpointPathError
from .lock import StoreLock, StoreLocked
from . import one_shot
from .plans import PlanTable
from .segments import SegmentTable, finite
from .store import Store
from .trainer import Trainer
from .trials import Trial, TrialRunner, TrialState


_log = logging.getLogger("retiarii.engine")


class ExperimentError(RuntimeError):
    """An experiment that cannot start or resume as asked; the message says why and the fix."""


class EnvironmentFailure(ExperimentError):
    """The run stopped because its environment kept failing (an I/O error such as a read-only
    checkpoint folder, lost workers, out of memory). Nothing is lost: fix the cause, then
    ``resume()``; the trials it failed are retried."""


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
    except Exception as e:  # noqa: BLE001 (the script fails when loaded as a module)
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
    spec = trainer.to_spec()
    return (object_ref(trainer, "trainer") if spec is None else spec), trainer.value_choices()


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
    out = {"bases": [g.structural_hash() for g, _ in space.bases],
           "mutators": [[type(b.mutator).__name__, b.mutator.label] for b in space.mutators],
           "hparams": {k: v.values for k, v in space.hparams.items()}}
    frozen = space.frozen_fingerprint()
    if frozen is not None:  # only spaces with frozen values: older stores still resume
        out["frozen"] = frozen
    return out


# ---- the experiment -----------------------------------------------------------------------


class Experiment:
    """Search ``space`` with ``strategy``, training each model with ``trainer``.

    Args:
        space: a :class:`~retiarii.ModelSpace` defined at module level (or its reference).
        strategy: instantiation control, e.g. ``rt.strategies.Random(seed=0)``.
        trainer: a :class:`~retiarii.Trainer`; its ValueChoice settings become choices.
        store: the SQLite file (created with its folder). Checkpoints go in the folder next to
            it (``runs/exp.db`` -> ``runs/exp.checkpoints/``), recorded relative to it: move or
            copy the two together and resume the copy.
        workers: worker processes (one per GPU in ``devices``, else CPU shares).
        devices: GPU ids; None uses every visible GPU, [] forces CPU.
        max_models: stop proposing after this many distinct models.
        max_time: seconds; no new segment starts after it (running ones pause).
        seed: seeds the trials' weights and data order (trial i gets seed + i).
        scheduler: training control (``rt.strategies.ASHA(...)``...); default: train every
            model for the trainer's epochs.
        metric, mode: the reported metric the strategy optimizes, and its direction.
        max_failures: retries of a trial, from its last checkpoint, after failures of the
            environment (an I/O error, a lost worker, out of memory); when they persist the run
            stops with :class:`EnvironmentFailure`, resumable.
        model_retries: retries after the model's own failure (a shape error, a NaN loss),
            which is deterministic: none by default.
        dedup: do not train a structure (same structural hash and hyper-parameters) twice.
        executor: an :class:`~.executors.Executor` to use instead of local processes, or
            ``"ray"`` for a :class:`~.executors.ray.RayExecutor` with ``workers`` slots
            (``"local"``, the default, is the same as None).
        progress: called with a summary dict after each finished trial (the CLI's display).
        origin: JSON kept with the experiment saying how it was made (the CLI's flags, so
            that ``retiarii resume`` can rebuild it); not compared on resume.
        optimize: cross-model optimization (docs/optimization.md). ``"auto"`` (default):
            up to ``batch_models`` trials that read the same batches (equal
            ``Trainer.data_key``) train as one job: one data pipeline, their common frozen
            layers once; each group is measured and reverted when slower than its models
            apart. ``True``: the same, never reverted for speed. ``False``: every model
            trains alone (the baseline). ``"pack"``: jobs packed as with True, but each model
            of a job trains alone in it (the paper's packing without merging; a baseline).
            Results are the same either way (bit for bit on CPU).
        batch_models: the most trials one job trains when optimizing (the paper plans in
            batches of 50; 8 keeps a job's memory modest).
        fuse: whether the trials of a grouped job with one architecture (the same choices,
            other hyper-parameters or seeds) train as one fused model (docs/optimization.md,
            "Fused training of same-shape models"). ``"auto"`` (the default under
            ``optimize="auto"``): when measured faster than the other layouts (the first job
            of a group key and device measures them; "Choosing a layout"), reverted when a
            segment measures it slower. ``True``: fused whenever possible. ``False`` (the
            default under ``optimize=True``): never, so a search's results are those of
            training alone bit for bit on CPU; fused results equal training alone within
            float rounding (1e-6 relative on CPU).
        batching: grouped jobs also batch frozen per-example layers that the models feed with
            different values (an adapter before a frozen layer; docs/optimization.md,
            "batching"). ``"auto"`` (the default under ``optimize="auto"``): when measured
            faster than CSE alone (on a CPU it pays only for small batches:
            benchmarks/README.md); ``True``: always; ``False`` (the default under
            ``optimize=True``): never. Exact on CPU either way.
        packing: how the trials of a batch are split over the free workers
            (docs/optimization.md, "Packing onto devices"): by their profiles (True: models
            of similar iteration time together, every worker about equally busy, no job
            over its worker's memory; the profile is estimated from each model's IR when it
            is proposed, then scaled by what workers measure), or as evenly as they go
            (False). ``"auto"`` (default): on when the workers train on GPUs, where memory
            decides what fits; off on a CPU-only machine, where an even split measured as
            fast (benchmarks/README.md, "packing_e2e").
        dedicated: modules that get a device of their own (docs/optimization.md, "Dedicated
            devices"): names as in the model (``fnmatch`` patterns: ``"encoder"``,
            ``"backbone.*"``) or class names (``"TransformerEncoder"``). A grouped job whose
            shared frozen part holds one computes that part on its own device one batch ahead
            of the models: another GPU, a side stream of the only one, or on a CPU-only
            machine a process (``dedicated_device``: ``"process"``, ``"thread"``,
            ``"cuda:N"`` to choose). Results are unchanged (bit for bit on CPU).
        weight_sharing: wrap the multi-trial ``strategy`` in
            :class:`retiarii.strategies.WeightSharing`: the models it proposes train on one
            super-network's shared weights, as a one-shot search (docs/weight_sharing.md).
        ranks: one-shot searches only: each segment runs on this many local ranks with mixed
            parallelism (:mod:`retiarii.optim.mixed_parallel`: each rank trains its own sampled
            model on its share of the batches; a GPU per rank when there are enough, else
            gloo). The strategy must support it (SPOS, ENAS, WeightSharing).

    A one-shot ``strategy`` (:class:`~retiarii.strategies.one_shot.OneShot`: DARTS, SPOS,
    ENAS...) runs segment by segment in a worker (:mod:`.one_shot`); the options that only
    multi-trial searches use (scheduler, max_models, optimize=True or "pack", fuse, batching,
    packing=True, dedicated, model_retries) are refused with it.
    """

    def __init__(self, space, strategy, trainer: Trainer, store: str = "runs/experiment.db",
                 workers: int = 2, devices=None, max_models: int | None = None,
                 max_time: float | None = None, seed: int = 0,
                 scheduler: Scheduler | None = None, metric: str = "val_acc", mode: str = "max",
                 max_failures: int = 3, model_retries: int = 0, dedup: bool = True, executor=None,
                 progress: Callable[[dict], None] | None = None, origin: dict | None = None,
                 optimize: bool | str = "auto", batch_models: int = 8,
                 fuse: bool | str | None = None, batching: bool | str | None = None,
                 weight_sharing: bool = False, ranks: int = 1, packing: bool | str = "auto",
                 dedicated: list[str] | None = None, dedicated_device: str | None = None):
        if optimize not in ("auto", True, False, "pack"):
            raise ExperimentError(f"optimize={optimize!r}: give 'auto', True, False or 'pack'")
        if packing not in ("auto", True, False):
            raise ExperimentError(f"packing={packing!r}: give 'auto', True or False")
        self.packing = packing  # "auto": decided in _loop, once the executor is known
        if dedicated is not None and (isinstance(dedicated, str) or not all(
                isinstance(p, str) and p for p in dedicated)):
            raise ExperimentError(f"dedicated={dedicated!r}: give a list of module names or "
                                  f"class names, e.g. ['encoder']")
        if dedicated_device not in (None, "process", "thread") and not str(
                dedicated_device).startswith("cuda"):
            raise ExperimentError(f"dedicated_device={dedicated_device!r}: give 'process', "
                                  f"'thread' or 'cuda:N' (None: chosen per worker)")
        self.dedicated = {"dedicated": list(dedicated)} if dedicated else {}
        if dedicated and dedicated_device:
            self.dedicated["dedicated_device"] = dedicated_device
        for name, value in (("fuse", fuse), ("batching", batching)):
            if value not in ("auto", True, False, None) or isinstance(value, (int, float)) \
                    and not isinstance(value, bool):
                raise ExperimentError(f"{name}={value!r}: give 'auto', True or False (or leave "
                                      f"it out: 'auto' under optimize='auto', else False)")
        # Left out: chosen by measurement when the search measures (optimize="auto"), off when
        # it groups by keys alone (optimize=True: nothing measured, results bit for bit).
        default = "auto" if optimize == "auto" else False
        self.fuse = default if fuse is None else fuse
        self.batching = default if batching is None else batching
        if not isinstance(batch_models, int) or batch_models < 1:
            raise ExperimentError(f"batch_models={batch_models!r}: give a number of trials >= 1")
        self.optimize, self.batch_models = optimize, batch_models
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
        self.metric, self.mode = metric, Mode.parse(mode, "Experiment")
        self.max_failures, self.dedup = max_failures, dedup
        self.model_retries = model_retries
        if isinstance(executor, str) and executor not in ("local", "ray"):
            raise ExperimentError(f"executor={executor!r}: give 'local', 'ray' or an Executor")
        self.executor, self.progress, self.origin = executor, progress, origin
        if not isinstance(weight_sharing, bool):
            raise ExperimentError(f"weight_sharing={weight_sharing!r}: give True or False")
        if weight_sharing:
            self.strategy = strategy = one_shot.wrap_weight_sharing(strategy, trainer,
                                                                 ExperimentError)
        self.one_shot = isinstance(strategy, OneShot)
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            raise ExperimentError(f"ranks={ranks!r}: give a number of ranks >= 1")
        if ranks > 1 and not self.one_shot:
            raise ExperimentError(f"ranks={ranks} runs a one-shot segment on several ranks; "
                                  f"{type(strategy).__name__} is multi-trial: use workers= to "
                                  f"train its models in parallel, or weight_sharing=True")
        self.ranks = ranks
        if self.one_shot:
            one_shot.check_options(strategy, ExperimentError, scheduler=scheduler,
                                   optimize=optimize, fuse=fuse, batching=batching,
                                   max_models=max_models, model_retries=model_retries,
                                   trainer_hparams=hp, executor=executor, packing=packing,
                                   dedicated=dedicated)
        self.store: Store | None = None
        self._known: dict[str, float | None] = {}  # dedup key -> final value (None: pending)
        self._keys: dict[int, str] = {}  # model id -> dedup key, until its trial ends
        self._count = 0  # models proposed so far (this experiment, resumes included)
        self._model_of: dict[str, int] = {}  # sample key -> model id (parents of children)
        self._lock: StoreLock | None = None
        self._data_keys: dict[str, Any] = {}  # hparams (JSON) -> the trainer's data key

    # ---- public ---------------------------------------------------------------------------
    def config(self) -> dict:
        """What a resume must match (budgets may change between runs)."""
        if self.one_shot:
            config = {"space": {"ref": self.space_ref, **_space_fingerprint(self.search_space)},
                      "strategy": one_shot.one_shot_spec(self.strategy),
                      "trainer": self.trainer_spec, "seed": self.seed, "metric": self.metric,
                      "mode": self.mode}
            if self.ranks > 1:  # other ranks, other samples per step: another search
                config["ranks"] = self.ranks
            return config
        return {"space": {"ref": self.space_ref, **_space_fingerprint(self.search_space)},
                "strategy": {"class": ref_of(type(self.strategy)),
                             "config": self.strategy.config(),
                             "seed": getattr(self.strategy, "seed", None)},
                "scheduler": {"class": ref_of(type(self.scheduler))},
                "trainer": self.trainer_spec, "seed": self.seed, "metric": self.metric,
                "mode": self.mode, "dedup": self.dedup}

    def run(self, max_models: int | None = None, max_time: float | None = None) -> dict:
        """Start a new experiment in the store and run it to the end; returns a summary."""
        self._budgets(max_models, max_time)
        self._open()
        try:
            self.store.add_experiment({**self.config(), "origin": self.origin}, self.seed,
                                      name=os.path.basename(self.path))
            return self._loop(resume=False)
        finally:
            self._close()

    def resume(self, max_models: int | None = None, max_time: float | None = None) -> dict:
        """Continue the latest experiment of the store (after Ctrl-C, a crash or SIGKILL)."""
        self._budgets(max_models, max_time)
        if not os.path.isfile(self.path):
            raise ExperimentError(f"{self.path} does not exist: nothing to resume (check the "
                                  f"path, or run() a new experiment)")
        self._open()
        try:
            return self._resume()
        finally:
            self._close()

    def _resume(self) -> dict:
        experiments = self.store.experiments()
        if not experiments:
            raise ExperimentError(f"{self.path} holds no experiment to resume; use run()")
        saved = _comparable(self.store.use_experiment(experiments[-1]["id"])["config"])
        mine = _comparable(json.loads(json.dumps(self.config())))
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
        if self.one_shot and max_models is not None:
            raise ExperimentError(f"max_models={max_models!r} does not apply to the one-shot "
                                  f"strategy {type(self.strategy).__name__}: its segments decide "
                                  f"how many models it evaluates; leave max_models out")
        self.max_models = max_models if max_models is not None else self.max_models
        self.max_time = max_time if max_time is not None else self.max_time

    def _open(self):
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        # One driver per store, for its whole life (before anything is written).
        self._lock = StoreLock(self.path)
        try:
            self._lock.acquire()
        except StoreLocked as err:
            raise ExperimentError(str(err)) from None
        try:
            self.store = Store(self.path)
        except BaseException:
            self._lock.release()
            raise
        self.checkpoint_dir = self.store.checkpoint_dir  # the run's own: nothing outside it
        self.folder = CheckpointDir(self.checkpoint_dir)

    def _close(self) -> None:
        """The driver ends: the store is closed (its write-ahead log folded into the file, so
        the .db alone holds the whole run and can be copied), then the lock is released."""
        try:
            if self.store is not None and self.store.db is not None:
                self.store.close()
        finally:
            self._lock.release()

    def _loop(self, resume: bool) -> dict:
        store = self.store
        eid = store.experiment_id
        if resume:
            dropped = store.drop_untrained_orphans()
            if dropped:
                _log.warning("dropped models %s: recorded without their trial by a crash "
                             "(they never trained; the strategy may propose them again)",
                             dropped)
        models = store.models()
        for row in models:
            self._model_of[sample_key(row["sample"])] = row["id"]
            if row["hash"]:
                key = self._dedup_key(row["hash"], row["sample"])
                self._known[key] = row.get("value")
                if row["status"] == ModelStatus.TRAINING:  # its trial resumes below
                    self._keys[row["id"]] = key
        self._count = len(models)
        executor = self._executor()
        if self.one_shot:
            return self._one_shot_loop(executor, resume)
        epochs = getattr(self.trainer, "epochs", None)
        source = None if self.scheduler.spawns_trials else self._next_trial
        kwargs = dict(max_failures=self.max_failures, model_retries=self.model_retries,
                      max_steps=epochs,
                      checkpoint_dir=self.checkpoint_dir, source=source,
                      on_result=self._on_result, on_trial_end=self._on_trial_end,
                      id_prefix=f"e{eid}-", spawn_config=self._spawn_config)
        if self.optimize:
            kwargs.update(batch_models=self.batch_models, group_key=self._group_key,
                          profile=self.optimize == "auto", on_group=self._on_group,
                          fuse=self.fuse, batching=self.batching, packing=self._packs(executor),
                          merge=self.optimize != "pack", dedicated=self.dedicated,
                          slot_memory=getattr(
                              executor, "slot_memory", lambda: float("inf"))())
        self.runner = None
        started = time.monotonic()
        self._deadline = None if self.max_time is None else started + self.max_time
        store.set_experiment_status("running")
        try:
            if resume:
                self.folder.remove_temporaries()  # half-written by workers killed with us
                runner = TrialRunner.resume(executor, self.scheduler, store, **kwargs)
                plans = PlanTable(store)  # groups reverted or failed before stay apart
                runner.alone, runner.alone_s = plans.alone_trials(), plans.alone_profiles()
                runner.unfused = plans.unfused_trials()
                runner.layouts = plans.layout_decisions()  # measured before: not again
                self._rebind(runner)
                self.runner = runner
                self._finish_half_ended(runner)
            else:
                runner = TrialRunner(executor, self.scheduler, store, **kwargs)
            self.runner = runner
            runner.run()
            store.flush()
            done = not runner.budget_hit() and runner.stop_reason is None
            store.set_experiment_status("done" if done else "stopped")
            if runner.stop_reason is not None:
                raise EnvironmentFailure(
                    f"{self.path}: stopped, {runner.stop_reason}. Nothing is lost: fix the "
                    f"cause, then resume (retiarii resume {self.path}, or Experiment.resume())")
        except KeyboardInterrupt:
            store.set_experiment_status("interrupted")
            raise
        finally:
            if executor is not self.executor:  # made here (None or "ray"): ours to close
                executor.close()
            store.flush()
        return self.summary()

    def _executor(self):
        executor = self.executor
        if executor is None or executor == "local":
            from .executors.local import LocalExecutor

            if not self.one_shot:
                return LocalExecutor(self.workers, self.devices)
            # a one-shot search runs one segment at a time: one worker does it all, seeing a
            # GPU per rank when there are enough (its ranks then use NCCL)
            devices = self.devices
            if self.ranks > 1:
                from .executors.local import visible_gpus

                gpus = [str(d) for d in (devices if devices is not None else visible_gpus())]
                if len(gpus) >= self.ranks:
                    devices = [",".join(gpus[:self.ranks])]
            return LocalExecutor(1, devices)
        if executor == "ray":  # a slot per worker on Ray (docs/ray.md); closed at the end
            from .executors.ray import RayExecutor

            return RayExecutor(1 if self.one_shot else self.workers, ranks=self.ranks)
        return executor

    def _one_shot_loop(self, executor, resume: bool) -> dict:
        """Host the one-shot strategy (:class:`~.one_shot.OneShotRun`) to its end."""
        started = time.monotonic()
        self._deadline = None if self.max_time is None else started + self.max_time
        self.store.set_experiment_status("running")
        try:
            if resume:
                self.folder.remove_temporaries()  # half-written by workers killed with us
            status, why = one_shot.OneShotRun(self, executor).run(self._deadline)
            if status == "environment":
                self.store.set_experiment_status("stopped")
                raise EnvironmentFailure(
                    f"{self.path}: stopped, {why}. Nothing is lost: fix the cause, then resume "
                    f"(retiarii resume {self.path}, or Experiment.resume())")
            if status == "failed":  # the store already says failed, and why
                raise ExperimentError(f"{self.path}: {why} (recorded: retiarii status "
                                      f"{self.path})")
            self.store.set_experiment_status(status)
        except KeyboardInterrupt:
            self.store.set_experiment_status("interrupted")
            raise
        finally:
            if executor is not self.executor:  # made here (None or "ray"): ours to close
                executor.close()
            self.store.flush()
        return self.summary()

    def _rebind(self, runner: TrialRunner) -> None:
        """Point resumed trials' specs at this process's space and trainer. The references
        recorded when a trial was added name files where they were then; the run directory
        (and the space file with it) may have moved since, and the resume check has already
        verified that the space and trainer are the same."""
        for trial in runner.trials.values():
            if "space" in trial.config:
                trial.config["space"] = self.space_ref
            if "trainer" in trial.config:
                trial.config["trainer"] = self.trainer_spec

    def _finish_half_ended(self, runner: TrialRunner) -> None:
        """Complete the end of trials whose ending the driver journaled but whose effects (the
        model's status, the strategy told) it died before writing: those are written in one
        transaction (:meth:`_on_trial_end`), so a model still ``training`` means none were."""
        training = {row["id"] for row in self.store.models("training")}
        ended = [t for t in runner.trials.values()
                 if t.config.get("model_id") in training
                 and (t.state is TrialState.TERMINATED or t.state is TrialState.ERRORED)]
        if not ended or self.scheduler.spawns_trials:
            return  # PBT's trials share models: a model's status follows its last trial
        order = {row["id"]: row["ended"] or 0.0 for row in self.store.trials()}
        for trial in sorted(ended, key=lambda t: order.get(t.trial_id, 0.0)):
            self._on_trial_end(trial, report=False)

    def _group_key(self, trial: Trial) -> Any:
        """What trials must share to train in one job: the space, the trainer and the data
        key of their hyper-parameters (None: the trainer shares nothing; alone)."""
        config = trial.config
        if "sample" not in config or "trainer" not in config:
            return None
        hparams = json.dumps(config.get("hparams") or {}, sort_keys=True, default=str)
        if hparams not in self._data_keys:
            try:
                self._data_keys[hparams] = self.trainer.data_key(config.get("hparams") or {})
            except Exception as err:  # noqa: BLE001 (a trainer that cannot say shares nothing)
                _log.warning("%s.data_key failed (%s): its trials train alone",
                             type(self.trainer).__name__, err)
                self._data_keys[hparams] = None
        key = self._data_keys[hparams]
        if key is None:
            return None
        return (json.dumps(config["space"], sort_keys=True, default=str),
                json.dumps(config["trainer"], sort_keys=True, default=str), key)

    def _on_group(self, record: dict) -> None:
        PlanTable(self.store).add(record)
        if record["status"] in ("reverted", "failed"):
            _log.info("group %s %s: %s", record["job_id"], record["status"], record["reason"])

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
                # One torch thread: a one-sample shape check gains nothing from more, and with
                # the workers on every core more threads only wait for cores (threads.py)
                with one_thread():
                    if model is None:  # not drawn (a strategy that proposes without drawing)
                        model = self.search_space.instantiate(sample)
                    else:
                        self.search_space.check_shapes(model)
            except (ShapeMismatchError, MutationError, SampleError) as e:
                self._count += 1  # a model that cannot be built fails alone, recorded
                _log.warning("model %s cannot be built, recorded as failed: %s", sample, e)
                self.store.add_model(sample, None, None, status=ModelStatus.FAILED)
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
            # The model, its trial and the strategy's state after proposing it are written in
            # one transaction, when the runner journals the trial: a crash leaves all or none
            # of them, and a resumed strategy proposes exactly what an uninterrupted one does.
            parent = self.strategy.parent_of(sample)
            model_id = self.store.stage_model(
                sample, model.graph.to_data(), structure,
                parent=None if parent is None else self._model_of.get(sample_key(parent)),
                with_it=[self._save_strategy])
            self._model_of[sample_key(sample)] = model_id
            self._known[key] = None
            self._keys[model_id] = key
            config = {"space": self.space_ref, "trainer": self.trainer_spec,
                      "sample": {k: v for k, v in sample.items()
                                 if k not in self._trainer_labels},
                      "hparams": model.hparams, "seed": self.seed + self._count - 1,
                      "model_id": model_id, "choices": sample, "checked": True}
            if self.optimize and getattr(getattr(self, "runner", None), "packing", False):
                config["profile"] = self._estimate(model)
            frozen = self.space.frozen_fingerprint()
            if frozen is not None:  # the worker checks its frozen values are the driver's
                config["frozen"] = frozen
            return config
        return None

    def _packs(self, executor) -> bool:
        """Whether batches are packed by profile: ``packing``, where ``"auto"`` is on when the
        workers train on GPUs (where memory decides what fits; on a CPU-only machine
        benchmarks/packing_e2e.py measured an even split as fast)."""
        if self.packing != "auto":
            return bool(self.packing)
        return bool(getattr(executor, "devices", None))

    def _estimate(self, model) -> dict | None:
        """The packing profile of a proposed model, estimated from its IR (shapes checked),
        at the trainer's batch size (engine/placing.py); None when it cannot be estimated."""
        from ..optim.profile import estimate_profile

        hparams = model.hparams or {}
        value = getattr(self.trainer, "value", None)
        try:
            batch = int(hparams.get("batch_size") or (value("batch_size", hparams) if value else 1))
            example = self.space.example_input
            example = example[0] if isinstance(example, (tuple, list)) else example
            units, memory = estimate_profile(model.graph, batch, example_batch=int(
                example.shape[0]) if getattr(example, "ndim", 0) else 1)
        except Exception as err:  # noqa: BLE001 (no estimate: its batch is split evenly)
            _log.debug("no packing profile for %s: %s", model.sample, err)
            return None
        return {"units": round(units, 3), "memory": memory}

    def _spawn_config(self, spawn, parent: Trial | None) -> dict:
        """A scheduler's spawn (PBT) as a worker spec: a child keeps its parent's model and
        gets the spawn's hyper-parameters; a fresh trial takes a new model from the strategy."""
        if parent is not None:
            base = dict(parent.config)
            if base.get("model_id") is not None:
                # The child is a model of its own (the parent's architecture, new
                # hyper-parameters), derived from the parent's: models.parent says so.
                row = self.store.get_model(base["model_id"])
                base["model_id"] = self.store.stage_model(
                    row["sample"], row["graph"], row["hash"], parent=row["id"])
                self._count += 1
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
        for trial_id, step, name in checkpoints:
            if name in doomed:
                try:
                    self.folder.remove(name)  # refuses anything outside the run's folder
                except (CheckpointPathError, OSError) as err:
                    # kept, and its row with it: a full or read-only disk is not worth a crash
                    _log.warning("trial %s: could not delete its checkpoint of step %d: %s",
                                 trial_id, step, err)
                    continue
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
        except UnknownSample:
            # A trial resumed after a crash whose sample the restored strategy has not proposed
            # (again) yet: it learns the final value when it proposes it (see _next_trial).
            pass

    def _on_trial_end(self, trial: Trial, report: bool = True) -> None:
        # The model's status and the strategy's state are one transaction: a model still
        # ``training`` after a crash tells resume that this end has to be done again.
        with self.store.transaction():
            self._end_model(trial)
        self._collect_garbage(trial)
        if self.progress is not None and report:
            self.progress(self.summary())

    def _end_model(self, trial: Trial) -> None:
        sample, model_id = trial.config.get("choices"), trial.config.get("model_id")
        reported = (trial.last_result or {}).get(self.metric)
        value = finite(reported)
        if reported is not None and value is None:
            # NaN or inf (a diverged model, a broken metric) ranks nowhere: the model failed.
            _log.warning("trial %s ended with %s = %r, not a finite number: its model is "
                         "recorded as failed", trial.trial_id, self.metric, reported)
        failed = trial.state is TrialState.ERRORED or value is None
        if model_id is not None:
            self.store.set_model_status(
                model_id, ModelStatus.FAILED if failed else ModelStatus.TRAINED, value)
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
            except UnknownSample:
                pass  # not proposed by the restored strategy (yet): told when it proposes it
            self._save_strategy()

    def summary(self) -> dict:
        """Trials by state, the best finished models, models proposed, trials running now."""
        if self.store is not None and self.store.db is None:  # the driver has ended
            with Store(self.path) as store:
                store.use_experiment(self.store.experiment_id)
                return self._summary(store)
        return self._summary(self.store)

    def _summary(self, store: Store) -> dict:
        if self.one_shot:
            table = SegmentTable(store)
            search = table.summary(self.strategy.num_segments(), self.mode)
            return {"store": self.path, "models": search["models"], "trials": {},
                    "best": search["best"], "running": 0, "max_models": None,
                    "one_shot": search}
        counts = store.counts_by_state()
        best = store.best_models(self.metric, self.mode, 5, finished=True)
        runner = getattr(self, "runner", None)
        running = runner.running if runner is not None else counts.get("RUNNING", 0)
        out = {"store": self.path, "models": self._count, "trials": counts, "best": best,
               "running": running, "max_models": self.max_models}
        plans = PlanTable(store).summary()
        if plans["jobs"]:
            out["optimization"] = plans
        return out


def _comparable(config: dict) -> dict:
    """An experiment's config as resume compares it: where the space and trainer files lie is
    left out (a run directory may be moved or copied with its space file); what they define
    is compared (the space's fingerprint, the trainer's settings)."""
    config = dict(config)
    config.pop("origin", None)
    if isinstance(config.get("space"), dict):
        config["space"] = {k: v for k, v in config["space"].items() if k != "ref"}
    if isinstance(config.get("trainer"), str):  # a reference: its file may have moved
        config["trainer"] = config["trainer"].rsplit(":", 1)[-1]
    return config
