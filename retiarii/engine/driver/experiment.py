"""The experiment: a space and a strategy become trained models, every fact in SQLite.

The engine owns the loop; the algorithms only return decisions. A :class:`~.trials.TrialRunner`
keeps every worker busy and applies the scheduler's decisions (training control); whenever a
slot is free and nothing waits to resume, it asks this experiment for a new trial, which asks
the strategy for a sample (instantiation control), instantiates it through the space (shapes
checked), skips structures already trained, and records the model before it is trained. When a
trial ends its final metric goes back to the strategy. The store journals everything before it
takes effect, so after a crash (even SIGKILL) ``resume()`` carries on: finished trials kept,
running ones from their last checkpoint, strategy and scheduler from their saved state.

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

import json
import logging
import os
import time
from typing import Callable

from ...determinism import check as check_deterministic
from ...enums import Mode
from ...objectives import ObjectiveError, Objectives
from ...optim.config import OptimizeConfig
from ...refs import resolve_ref
from ...strategies.one_shot.base import OneShot
from ...strategies.schedulers.base import Scheduler
from ..storage.checkpoint import CheckpointDir
from .experiment_checks import (check_arguments, check_costs, check_ranks, optimize_config,
                                resolve_scheduler, resolve_strategy, warn_budget)
from .failures import SearchFailed, with_failures
from .experiment_support import (EnvironmentFailure, ExperimentError, comparable,
                                 experiment_config, object_ref, recorded_config, trainer_spec)
from ..trainers.function_trainer import experiment_space
from ..storage.lock import StoreLock, StoreLocked
from . import crash_repair, one_shot_host as one_shot
from ..storage import base_graphs
from ..runner.planner import JobPlanner
from ..runner.packer import Packer
from ..executors.warm import start_server_for
from ..storage.plans_table import PlanTable
from ..storage.result_model import record_selection
from ..jobs.reports import PlanRecord
from .proposals import Proposals
from .run_summary import run_summary
from ..errors import stopped
from ..storage.store import Store
from ..trainers.trainer import Trainer
from ..runner.trial_runner import TrialRunner

__all__ = ["EnvironmentFailure", "Experiment", "ExperimentError", "SearchFailed", "object_ref",
           "trainer_spec"]

_log = logging.getLogger("retiarii.engine")


# ---- the experiment -----------------------------------------------------------------------


class Experiment:
    """Search ``space`` with ``strategy``, training each model with ``trainer``.

    Args:
        space: a :class:`~retiarii.ModelSpace` defined at module level (or its reference);
            None with a :class:`~.function_trainer.FunctionTrainer`: a model-free search of
            its hyper-parameters (the function gets ``model=None``).
        strategy: instantiation control, e.g. ``rt.strategies.Random(seed=0)``, or its name
            in :mod:`retiarii.registry` (``"evolution"``: built with ``seed``, as
            ``retiarii run --strategy evolution`` builds it). Every argument is checked here,
            before anything is written; a name not found is refused with the valid ones.
        trainer: a :class:`~retiarii.Trainer`; its ValueChoice settings become choices.
        store: the SQLite file (created with its folder). Checkpoints go in the folder next to
            it (``runs/exp.db`` -> ``runs/exp.checkpoints/``), recorded relative to it: move or
            copy the two together and resume the copy.
        workers: worker processes (one per GPU in ``devices``, else CPU shares).
        devices: GPU ids; None uses every visible GPU, [] forces CPU.
        max_models: stop proposing after this many distinct models.
        max_time: seconds; no new segment starts after it (running ones pause).
        seed: seeds the trials' weights and data order (trial i gets seed + i).
        scheduler: training control (``rt.strategies.ASHA(...)``..., or a name: ``"asha"``,
            ``"median"``); default: train every model for the trainer's epochs.
        metric, mode: the reported metric the strategy optimizes, and its direction; or
            lists of several metrics and their directions (``metric=["val_acc",
            "latency_ms"], mode=["max", "min"]``): a multi-objective search, whose result
            is its Pareto front (docs/multi_objective.md). The strategy must take several
            objectives (evolution, TPE, predictor, random, grid, RL with a reward). A metric
            may be a cost the engine measures (``params``, ``latency_ms``: engine/costs.py).
        constraints: conditions every result must meet (``["latency_ms <= 5", "params <=
            2e6"]``): a model that misses one is never on the front (with one metric, never
            the best, and its strategy is told it failed).
        costs: your own costs, name -> a function of the built module (in eval mode)
            returning a number, measured once per architecture like the engine's own
            (``params``, ``flops``, ``peak_mem_mb``, ``latency_ms``, ``latency_batch_ms``;
            engine/costs.py); objectives and constraints may name them.
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
        optimize, batch_models, fuse, passes, batching, packing, dedicated, dedicated_device:
            cross-model optimization (docs/optimization.md), each option as
            :class:`~retiarii.OptimizeConfig` documents it (``optimize`` is its ``mode``:
            ``"auto"`` by default, ``True``, ``False`` the baseline, ``"pack"``);
            ``batching=`` is ``passes={"batching": ...}``. ``optimize`` may instead be a whole
            ``OptimizeConfig`` (then leave the others out). Results equal training each model
            alone: bit for bit on CPU unless a layout fuses (within float rounding then).
        weight_sharing: wrap the multi-trial ``strategy`` in
            :class:`retiarii.strategies.WeightSharing`: the models it proposes train on one
            super-network's shared weights, as a one-shot search (docs/weight_sharing.md).
            True shares every operator; a list of module path patterns (``["stem",
            "cells.*"]``) annotates the operators whose weights are shared, the others being
            private to each architecture.
        ranks: one-shot searches only: each segment runs on this many local ranks with mixed
            parallelism (:mod:`retiarii.optim.mixed_parallel`: each rank trains its own sampled
            model on its share of the batches; a GPU per rank when there are enough, else
            gloo). The strategy must support it (SPOS, ENAS, WeightSharing).
        device_memory: one-shot searches only: the bytes of a device the shared weights (with
            their gradients and optimizer state) may take, as a number or a size
            (``"20GiB"``). A super-graph larger than that is split over the ranks, each holding
            what its models use, the rest in host memory (:mod:`retiarii.optim.split`; issue
            #14 item 5). The strategy must support it (SPOS, ENAS; WeightSharing offloads
            on its one rank). None: no limit.
        deterministic: train in deterministic mode (:mod:`retiarii.determinism`;
            docs/engine.md, "Deterministic mode"): every process that trains (workers, Ray
            actors, ranks, a dedicated module's process) uses deterministic kernels only, no
            TF32, no cuDNN benchmarking and cuBLAS's reproducible workspace, so two runs of a
            search on a GPU give the same metrics (at a cost in speed). Kept with the
            experiment: a resume must ask for the same.

    A one-shot ``strategy`` (:class:`~retiarii.strategies.one_shot.OneShot`: DARTS, SPOS,
    ENAS...) runs segment by segment in a worker (:mod:`.one_shot`); the options that only
    multi-trial searches use (scheduler, max_models, optimize=True or "pack", fuse, batching,
    packing=True, dedicated, model_retries) are refused with it.
    """

    def __init__(self, space, strategy, trainer: Trainer, store: str = "runs/experiment.db",
                 workers: int = 2, devices=None, max_models: int | None = None,
                 max_time: float | None = None, seed: int = 0,
                 scheduler: Scheduler | None = None, metric: str | list[str] = "val_acc",
                 mode: str | list[str] = "max", constraints: list[str] | None = None,
                 costs: dict[str, Callable] | None = None,
                 max_failures: int = 3, model_retries: int = 0, dedup: bool = True, executor=None,
                 progress: Callable[[dict], None] | None = None, origin: dict | None = None,
                 optimize: bool | str | OptimizeConfig = "auto", batch_models: int = 8,
                 fuse: bool | str | None = None, batching: bool | str | None = None,
                 passes: dict | None = None,
                 weight_sharing: bool | list[str] = False, ranks: int = 1,
                 device_memory: float | str | None = None, packing: bool | str = "auto",
                 dedicated: list[str] | None = None, dedicated_device: str | None = None,
                 deterministic: bool = False):
        try:
            self.deterministic = check_deterministic(deterministic)
        except ValueError as err:
            raise ExperimentError(str(err)) from None
        # Everything is checked before anything is kept: a refused experiment writes nothing.
        try:
            self.objectives = Objectives.of(metric, mode, constraints)
        except ObjectiveError as err:
            raise ExperimentError(str(err)) from None
        metric, mode = self.objectives.metrics[0], self.objectives.modes[0]
        check_arguments(trainer=trainer, store=store, workers=workers, devices=devices,
                        max_models=max_models, max_time=max_time, seed=seed, metric=metric,
                        max_failures=max_failures, model_retries=model_retries, dedup=dedup,
                        executor=executor, progress=progress, origin=origin)
        strategy = resolve_strategy(strategy, seed)
        if dedup and getattr(strategy, "repeats", 1) > 1:  # FixedArchitecture's runs
            raise ExperimentError(f"{type(strategy).__name__}(repeats={strategy.repeats}) "
                                  f"trains one structure several times, which dedup=True "
                                  f"would skip: pass dedup=False")
        scheduler = resolve_scheduler(scheduler, self.objectives, getattr(trainer, "epochs", None))
        self.optimization = optimize_config(optimize, batch_models=batch_models, fuse=fuse,
                                             batching=batching, passes=passes, packing=packing,
                                             dedicated=dedicated,
                                             dedicated_device=dedicated_device)
        opt = self.optimization
        self.optimize, self.batch_models = opt.mode, opt.batch_models
        self.packing = opt.packing  # "auto": decided in _loop, once the executor is known
        self.dedicated = {"dedicated": list(opt.dedicated)} if opt.dedicated else {}
        if opt.dedicated and opt.dedicated_device:
            self.dedicated["dedicated_device"] = opt.dedicated_device
        # Left out: the device model decides under optimize="auto"; off under True (bit for bit)
        self.fuse = opt.effective_fuse
        self.passes = opt.effective_passes
        # None: a model-free search (a FunctionTrainer's hparams alone); one-shot refused
        space = experiment_space(space, trainer, weight_sharing is not False
                                 or isinstance(strategy, OneShot), ExperimentError)
        self.space_ref = object_ref(space, "space")
        self.space = space if not isinstance(space, str) else resolve_ref(space)
        self.strategy, self.trainer = strategy, trainer
        self.trainer_spec, hp = trainer_spec(trainer)
        hp = {k: v for k, v in hp.items() if k not in self.space.hparams}
        # The strategy searches the space plus the trainer's ValueChoices; workers rebuild from
        # the space itself, so those labels are kept out of the sample they get.
        self.search_space = self.space.with_hparams(hp)
        trainer_labels = {self.search_space.hparam_labels()[k] for k in hp}
        self.path, self.workers, self.devices = str(store), workers, devices
        self.max_models, self.max_time, self.seed = max_models, max_time, seed
        self.scheduler = scheduler or Scheduler()
        self.metric, self.mode = metric, Mode.parse(mode, "Experiment")
        self.max_failures, self.dedup, self.model_retries = max_failures, dedup, model_retries
        self.executor, self.progress, self.origin = executor, progress, origin
        start_server_for(executor)  # local workers: their server imports torch while we set up
        if weight_sharing is not False:
            self.strategy = strategy = one_shot.wrap_weight_sharing(strategy, trainer,
                                                                 ExperimentError,
                                                                 weight_sharing)
        self.one_shot = isinstance(strategy, OneShot)
        if self.one_shot and self.objectives.extended:
            raise ExperimentError(f"{type(strategy).__name__} is a one-shot search of one "
                                  f"metric: several objectives and constraints need a "
                                  f"multi-trial strategy (evolution, TPE, predictor, random, grid)")
        if self.objectives.multi:
            try:
                strategy.use_objectives(self.objectives.modes, self.objectives.metrics)
            except ValueError as err:
                raise ExperimentError(f"metric={list(self.objectives.metrics)}: {err}") \
                    from None
        self.costs = check_costs(costs)
        self.ranks = check_ranks(ranks, strategy, self.one_shot)
        self.device_memory = one_shot.check_device_memory(strategy, device_memory,
                                                          self.one_shot, ExperimentError)
        if self.one_shot:
            shown = (dict(optimize=optimize, fuse=fuse, batching=batching, passes=passes,
                          packing=packing, dedicated=dedicated)
                     if not isinstance(optimize, OptimizeConfig) else
                     dict(optimize=opt.mode, fuse=opt.fuse, passes=opt.passes,
                          packing=opt.packing, dedicated=list(opt.dedicated)))
            one_shot.check_options(strategy, ExperimentError, scheduler=scheduler,
                                   max_models=max_models, model_retries=model_retries,
                                   trainer_hparams=hp, executor=executor, **shown)
            one_shot.check_shared(strategy, self.space, ExperimentError)
        self.store: Store | None = None
        self._lock: StoreLock | None = None
        self.runner: TrialRunner | None = None
        # the strategy's samples -> trials, trial ends -> feedback (a collaborator, not a base)
        self.proposals = Proposals(
            strategy=self.strategy, scheduler=self.scheduler, trainer=trainer, space=self.space,
            search_space=self.search_space, objectives=self.objectives, costs=self.costs,
            space_ref=self.space_ref, trainer_spec=self.trainer_spec,
            trainer_labels=trainer_labels, seed=seed, dedup=dedup,
            deterministic=self.deterministic, estimate_profiles=bool(self.optimize),
            on_end=self._report_progress)

    def _report_progress(self) -> None:
        if self.progress is not None:
            self.progress(self.summary())

    # ---- public ---------------------------------------------------------------------------
    @property
    def batching(self) -> bool | str:
        """The batching pass's setting in force (``passes["batching"]``)."""
        return self.passes.get("batching", False)

    def config(self) -> dict:
        """What a resume must match (budgets may change between runs)."""
        return experiment_config(self)

    def run(self, max_models: int | None = None, max_time: float | None = None) -> dict:
        """Start a new experiment in the store and run it to the end; returns a summary.

        Warns (:class:`~.experiment_checks.BudgetWarning`) when the model budget does not
        pass the strategy's random start-up; raises :class:`~.failures.SearchFailed` when
        every model failed (the store keeps each one's error)."""
        self._budgets(max_models, max_time)
        if not self.one_shot:
            warn_budget(self.strategy, self.max_models, self.workers,
                        self.batch_models if self.optimize else 1)
        else:  # before any worker starts
            one_shot.warn_held(self.strategy, one_shot.held_hparams(self.trainer.value_choices()))
        self._open()
        try:
            base_graphs.start(self.store, recorded_config(self), self.seed, self.path, self.search_space)
            return self._loop(resume=False)
        finally:
            self._close()

    def resume(self, max_models: int | None = None, max_time: float | None = None,
               experiment: int | None = None) -> dict:
        """Continue the latest experiment of the store (after Ctrl-C, a crash or SIGKILL), or
        experiment number ``experiment`` of it (``retiarii status`` lists them)."""
        self._budgets(max_models, max_time)
        if not os.path.isfile(self.path):
            raise ExperimentError(f"{self.path} does not exist: nothing to resume (check the "
                                  f"path, or run() a new experiment)")
        self._open()
        try:
            return self._resume(experiment)
        finally:
            self._close()

    def _resume(self, experiment: int | None) -> dict:
        ids = [e["id"] for e in self.store.experiments()]
        if not ids:
            raise ExperimentError(f"{self.path} holds no experiment to resume; use run()")
        if experiment is not None and experiment not in ids:
            raise ExperimentError(f"experiment={experiment!r}: {self.path} holds experiments "
                                  f"{', '.join(map(str, ids))}")
        eid = ids[-1] if experiment is None else experiment
        saved = comparable(self.store.use_experiment(eid)["config"])
        mine = comparable(json.loads(json.dumps(self.config())))
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
        self.proposals.open(self.store, self.folder)

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
            crash_repair.drop_untrained_orphans(store)
        self.proposals.restore()
        executor = self._executor()
        if self.one_shot:
            return one_shot.host(self, executor, resume)
        epochs = getattr(self.trainer, "epochs", None)
        proposals = self.proposals
        source = None if self.scheduler.spawns_trials else proposals.next_trial
        kwargs = dict(max_failures=self.max_failures, model_retries=self.model_retries,
                      max_steps=epochs,
                      checkpoint_dir=self.checkpoint_dir, source=source,
                      on_result=proposals.on_result, on_trial_end=proposals.on_trial_end,
                      id_prefix=f"e{eid}-", spawn_config=proposals.spawn_config)
        if self.optimize:
            kwargs.update(planner=JobPlanner(
                batch_models=self.batch_models, group_key=proposals.group_key,
                profile=self.optimize == "auto", fuse=self.fuse, passes=self.passes,
                merge=self.optimize != "pack", dedicated=self.dedicated,
                slots=getattr(executor, "num_slots", 1)),
                packer=Packer(self._packs(executor), getattr(
                    executor, "slot_memory", lambda: float("inf"))(), self.batch_models,
                    self.optimization.memory_budget),
                on_group=self._on_group)
        self.runner = None
        proposals.attach(None)
        started = time.monotonic()
        self._deadline = None if self.max_time is None else started + self.max_time
        proposals.budget(self.max_models, self._deadline)
        store.set_experiment_status("running")
        try:
            if resume:
                crash_repair.repair_checkpoints(store, self.folder)
                runner = TrialRunner.resume(executor, self.scheduler, store, **kwargs)
                # groups reverted or failed before stay apart; layouts are not measured again
                runner.planner.restore(PlanTable(store).memory())
                self._rebind(runner)
                self.runner = runner
                proposals.attach(runner)
                crash_repair.finish_half_ended(store, runner, proposals, self.scheduler)
            else:
                runner = TrialRunner(executor, self.scheduler, store, **kwargs)
            self.runner = runner
            proposals.attach(runner)
            try:
                runner.run()
            except EnvironmentFailure as err:  # the executor can no longer run anything
                runner.stop_reason = str(err)  # in-flight trials resume later, charged nothing
            store.flush()
            # a strategy whose method names its choice (a selected() method) has it recorded
            record_selection(store, getattr(self.strategy, "selected", lambda: None)())
            done = not runner.budget_hit() and runner.stop_reason is None
            store.set_experiment_status("done" if done else "stopped")
            if runner.stop_reason is not None:
                raise stopped(self.path, runner.stop_reason)
        except KeyboardInterrupt as err:
            store.set_experiment_status("interrupted")
            # shown under the traceback of a script's Ctrl-C (the CLI prints its own line)
            note = (f"retiarii: the search in {self.path} was interrupted; nothing is lost: "
                    f"continue it with Experiment.resume() or `retiarii resume {self.path}`")
            if hasattr(err, "add_note"):  # Python 3.11+
                err.add_note(note)
            raise
        finally:
            if executor is not self.executor:  # made here (None or "ray"): ours to close
                executor.close()
            store.flush()
        return with_failures(self.store, self.path, self.summary())  # or SearchFailed

    def _on_group(self, record: PlanRecord) -> None:
        PlanTable(self.store).add(record)
        if record.status in ("reverted", "failed"):
            _log.info("group %s %s: %s", record.job_id, record.status, record.reason)

    def _packs(self, executor) -> bool:
        """Whether batches are packed by profile: ``packing``, where ``"auto"`` is on when the
        workers train on GPUs (where memory decides what fits) or on two CPU slots or more
        (where each slot's pack should take as long as the others': split evenly by count, a
        space whose models differ in size left one worker idle for a third of a search,
        benchmarks/held_out.py), and off for one CPU worker (one slot: nothing to balance)."""
        if self.packing != "auto":
            return bool(self.packing)
        return bool(getattr(executor, "devices", None)) or getattr(executor, "num_slots", 1) > 1

    def _executor(self):
        executor = self.executor
        if executor is None or isinstance(executor, str):  # a name of the registry
            from ...registry import make_executor

            return make_executor(executor or "local", self.workers, self.devices,
                                 one_shot=self.one_shot, ranks=self.ranks)
        return executor

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

    def summary(self) -> dict:
        """Trials by state, the best finished models, models proposed, trials running now
        (:func:`.run_summary.run_summary`)."""
        return run_summary(self)
