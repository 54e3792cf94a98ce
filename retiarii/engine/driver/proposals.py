"""The multi-trial side of an experiment: the strategy's samples become trials, trial ends
become the strategy's feedback and the models' status.

:class:`Proposals` is a collaborator the :class:`~.experiment.Experiment` holds (the experiment
owns the store, the runner and the budgets and hands them over: :meth:`Proposals.open`,
:meth:`Proposals.attach`, :meth:`Proposals.budget`); what it keeps is the bookkeeping of the
proposals themselves: which structures are known, which models are in flight, the costs measured.

:meth:`Proposals.next_trial` is the runner's source: it asks the strategy, instantiates the
sample (shapes checked; a model that cannot be built fails alone, recorded), skips structures
already trained (``dedup``), and stages the model with the strategy's state in one
transaction. :meth:`Proposals.on_trial_end` writes the model's status and tells the strategy,
also in one transaction, then deletes the checkpoints the scheduler says nothing reads again.

Example (what the experiment does with it)::

    proposals = Proposals(strategy=..., space=..., search_space=..., trainer=..., ...)
    proposals.open(store, CheckpointDir(store.checkpoint_dir)); proposals.restore()
    proposals.budget(max_models=200, deadline=None)
    runner = TrialRunner(executor, scheduler, store, source=proposals.next_trial,
                         on_trial_end=proposals.on_trial_end, ...)
    proposals.attach(runner)
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any, Callable

from ...enums import ModelStatus
from ...mutator import MutationError
from ...sampler import SampleError, sample_key
from ...shapes import ShapeMismatchError
from ...strategies.multi_trial.base import SpaceExhausted, UnknownSample
from ...threads import one_thread
from ..storage.checkpoint import CheckpointPathError
from .costs import CostMeter
from .experiment_support import DrawnModels, ExperimentError
from .failures import build_error
from ..storage.pareto import FrontTable, Outcomes
from ..runner.trial_runner import Trial, TrialState

__all__ = ["Proposals"]

_log = logging.getLogger("retiarii.engine")


class Proposals:
    """Turning samples into trials and trial ends into feedback; see the module docstring.

    Args:
        strategy, scheduler, trainer: the experiment's own.
        space: the model space workers rebuild from; ``search_space``: it plus the trainer's
            ValueChoices, as the strategy searches it.
        objectives: the experiment's :class:`~retiarii.objectives.Objectives`.
        costs: the user's own costs (name -> function of the built module).
        space_ref, trainer_spec: what a worker rebuilds the space and trainer from.
        trainer_labels: the sample's labels that are the trainer's (kept out of the worker's).
        seed: trial i gets ``seed + i``.
        dedup: never train a structure (and its hyper-parameters) twice.
        deterministic: trials train in deterministic mode.
        estimate_profiles: the runner may pack or budget memory: each trial gets a profile.
        on_end: called after each trial's end is recorded (the experiment's progress report).
    """

    def __init__(self, *, strategy, scheduler, trainer, space, search_space, objectives,
                 costs: dict[str, Callable], space_ref: Any, trainer_spec: Any,
                 trainer_labels: set[str], seed: int, dedup: bool, deterministic: bool,
                 estimate_profiles: bool, on_end: Callable[[], None] | None = None):
        self.strategy, self.scheduler, self.trainer = strategy, scheduler, trainer
        self.space, self.search_space, self.objectives = space, search_space, objectives
        self.costs, self.space_ref, self.trainer_spec = costs, space_ref, trainer_spec
        self._trainer_labels, self.seed, self.dedup = trainer_labels, seed, dedup
        self.deterministic, self.estimate_profiles = deterministic, estimate_profiles
        self._on_end = on_end
        self._drawn = DrawnModels(search_space)
        self._outcomes = Outcomes(objectives)
        self.store = self.folder = self.runner = None
        self.max_models: int | None = None
        self._deadline: float | None = None
        self._meter: CostMeter | None = None
        self._costs: dict[int, dict] = {}  # model id -> its measured costs, until it ends
        # dedup key -> (what the strategy was told, violation); None: pending
        self._known: dict[str, tuple | None] = {}
        self._keys: dict[int, str] = {}  # model id -> dedup key, until its trial ends
        self.count = 0  # models proposed so far (this experiment, resumes included)
        self._model_of: dict[str, int] = {}  # sample key -> model id (parents of children)
        self._data_keys: dict[str, Any] = {}  # hparams (JSON) -> the trainer's data key

    # ---- what the experiment hands over -----------------------------------------------------
    def open(self, store, folder) -> None:
        """The store the driver opened and the run's checkpoint folder."""
        self.store, self.folder = store, folder

    def attach(self, runner) -> None:
        """The runner whose trials these are (None while :meth:`TrialRunner.resume` rebuilds
        it: ends replayed then delete no checkpoint)."""
        self.runner = runner

    def budget(self, max_models: int | None, deadline: float | None) -> None:
        """Stop proposing after ``max_models`` models or at ``deadline`` (time.monotonic)."""
        self.max_models, self._deadline = max_models, deadline

    def restore(self) -> None:
        """What the store already holds of this experiment: the models proposed (their dedup
        keys and outcomes, those still training) and, with several objectives, the front."""
        models = self.store.models()
        for row in models:
            self._model_of[sample_key(row["sample"])] = row["id"]
            if row["hash"]:
                key = self._dedup_key(row["hash"], row["sample"])
                self._known[key] = self._outcomes.known(row)
                if row["status"] == ModelStatus.TRAINING:  # its trial resumes
                    self._keys[row["id"]] = key
        self.count = len(models)
        if self.objectives.multi:  # the front kept so far, to extend
            table = FrontTable(self.store)
            ids = set(table.front_ids() or [])
            self._outcomes.front.members = {
                m["model_id"]: self.objectives.point(m["values"])
                for m in table.models() if m["model_id"] in ids}

    def _cost_meter(self) -> CostMeter:
        """The meter of the costs the objectives read (on this machine's CPU, one thread)."""
        if self._meter is None or self._meter.store is not self.store:
            from .costs import needed_costs

            value = getattr(self.trainer, "value", None)
            try:
                batch = int(value("batch_size", {})) if value else 1
            except (AttributeError, TypeError, ValueError):
                batch = 1  # a trainer without a batch size: latency_batch_ms at batch 1
            self._meter = CostMeter(self.store, self.space.example_input, batch,
                                    needed_costs(self.objectives.needed, self.costs),
                                    user=self.costs)
        return self._meter

    def group_key(self, trial: Trial) -> Any:
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

    def _dedup_key(self, structure_hash: str, sample: dict, spawned: dict | None = None) -> str:
        """The structure and every hyper-parameter the trial trains with: the sample's and a
        scheduler's own (``spawned``: a PBT trial's), which the documented rule counts too."""
        hp = {k: sample.get(label) for k, label in sorted(self.search_space.hparam_labels().items())}
        if spawned:
            hp.update({k: spawned[k] for k in sorted(spawned)})
        return hashlib.sha256(json.dumps([structure_hash, hp], default=str).encode()).hexdigest()

    def _reused_sample(self) -> dict | None:
        """An architecture for a PBT trial from scratch once the strategy has no new one (a
        population larger than the space; one fixed architecture whose learning rate PBT
        tunes): the experiment's architectures drawn afresh so far, in turn."""
        fresh = [m for m in self.store.models()
                 if m["parent"] is None and m["status"] != ModelStatus.FAILED]
        distinct = list({sample_key(m["sample"]): m["sample"] for m in fresh}.values())
        return dict(distinct[len(fresh) % len(distinct)]) if distinct else None

    def _budget_left(self) -> bool:
        if self.max_models is not None and self.count >= self.max_models:
            return False
        return self._deadline is None or time.monotonic() < self._deadline

    def next_trial(self, budgeted: bool = True, spawned: dict | None = None) -> dict | None:
        """The runner's source: the strategy's next model as a trial config, or None.
        ``spawned``: the hyper-parameters a scheduler gives the trial (PBT); they count in the
        dedup key, and an architecture is reused when the strategy has no new one."""
        duplicates = 0
        while not budgeted or self._budget_left():
            try:
                sample = self.strategy.ask(self._drawn)
            except SpaceExhausted:
                sample = None if spawned is None else self._reused_sample()
                if sample is None:
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
                self.count += 1  # a model that cannot be built fails alone, recorded
                _log.warning("model %s cannot be built, recorded as failed: %s", sample, e)
                self.store.add_model(sample, None, None, status=ModelStatus.FAILED,
                                     error=build_error(e))
                self.strategy.tell(sample, None)
                self._save_strategy()
                continue
            structure = model.structural_hash()  # hashes every node: compute it once
            key = self._dedup_key(structure, sample, spawned)
            if self.dedup and key in self._known:
                duplicates += 1
                if duplicates > 1000:
                    return None  # the strategy keeps proposing trained structures
                if key in self._keys.values():
                    # In flight: its trial tells the strategy when it ends. (After a resume this
                    # is the strategy asking again for a model it proposed after its last saved
                    # state: the trial already exists and carries on.)
                    continue
                self._tell(sample, *self._known[key])
                self._save_strategy()
                continue
            costs = self._proposal_costs(model, structure)
            ruled_out = self._outcomes.ruled_out(costs)
            if ruled_out is not None:  # a constraint rules it out: recorded, never trained
                self.count += 1
                _log.info("model %s %s", sample, ruled_out)
                self.store.add_model(sample, model.graph.to_data(), structure,
                                     status=ModelStatus.FAILED, error=ruled_out)
                self._known[key] = (None, 0.0)
                self.strategy.tell(sample, None)
                self._save_strategy()
                continue
            self.count += 1
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
            if costs:
                self._costs[model_id] = costs
            config = {"space": self.space_ref, "trainer": self.trainer_spec,
                      "sample": {k: v for k, v in sample.items()
                                 if k not in self._trainer_labels},
                      "hparams": model.hparams, "seed": self.seed + self.count - 1,
                      "model_id": model_id, "choices": sample, "checked": True}
            runner = self.runner
            if self.estimate_profiles and runner is not None and (
                    runner.packer.packing or runner.packer.budget != float("inf")):
                config["profile"] = self.estimate(model)  # packing, or the memory budget
            if costs:  # schedulers of several objectives read them (MOASHA, Scalarized)
                config["costs"] = costs
            if self.deterministic:  # its worker trains it in deterministic mode
                config["deterministic"] = True
            if parent is not None and getattr(self.strategy, "inherit_weights", False):
                donor = self._latest_checkpoint(self._model_of.get(sample_key(parent)))
                if donor is not None:  # starts from the parent's tensors that fit
                    config["inherit"] = donor
            frozen = self.space.frozen_fingerprint()
            if frozen is not None:  # the worker checks its frozen values are the driver's
                config["frozen"] = frozen
            return config
        return None

    def _latest_checkpoint(self, model_id: int | None) -> str | None:
        """The latest checkpoint name of the trial that trained model ``model_id`` (None: no
        such trial here, or it left none: a child of it then starts fresh)."""
        if self.runner is None or model_id is None:
            return None
        for trial in self.runner.trials.values():
            if trial.config.get("model_id") == model_id and trial.checkpoints:
                return trial.checkpoints[max(trial.checkpoints)]
        return None

    def estimate(self, model) -> dict | None:
        """The packing profile of a proposed model, estimated from its IR (shapes checked),
        at the trainer's batch size (engine/placing.py); None when it cannot be estimated."""
        from ...optim.profile import estimate_profile

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

    def spawn_config(self, spawn, parent: Trial | None) -> dict:
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
                self.count += 1
        else:  # the population needs a model: the model budget does not apply to it
            base = self.next_trial(budgeted=False, spawned=dict(spawn.config))
            if base is None:
                raise ExperimentError(
                    f"no model can start the new PBT trial {spawn.trial_id}: the strategy has "
                    f"none left and every architecture drawn so far failed or was already "
                    f"trained with the hyper-parameters {spawn.config}")
        return {**base, "hparams": {**base.get("hparams", {}), **spawn.config}}

    def collect_garbage(self, trial: Trial) -> None:
        """Delete the checkpoints the scheduler says nothing will read again (``trial``'s
        alone, unless the scheduler's trials share checkpoints)."""
        runner = self.runner
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
        # the file first, then its row: killed between the two, the driver leaves a row
        # naming no file, which the resume drops (Store.forget_missing_checkpoints); the other
        # order would leave a file no row names, which nothing would ever delete
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

    def on_result(self, trial: Trial, result: dict) -> None:
        sample = trial.config.get("choices")
        if sample is None:
            return
        try:
            self.strategy.on_step(sample, result["training_iteration"], result)
        except UnknownSample:
            # A trial resumed after a crash whose sample the restored strategy has not proposed
            # (again) yet: it learns the final value when it proposes it (see next_trial).
            pass

    def on_trial_end(self, trial: Trial, report: bool = True) -> None:
        # The model's status and the strategy's state are one transaction: a model still
        # ``training`` after a crash tells resume that this end has to be done again.
        with self.store.transaction():
            self._end_model(trial)
        self.collect_garbage(trial)
        if self._on_end is not None and report:
            self._on_end()

    def _tell(self, sample: dict, told, violation: float = 0.0) -> None:
        """Tell the strategy a result; the violation only with several objectives (a
        strategy of one metric was told an infeasible model as failed: engine/pareto.py)."""
        if self.objectives.multi and violation:
            self.strategy.tell(sample, told, violation)
        else:
            self.strategy.tell(sample, told)

    def _proposal_costs(self, model, structure: str) -> dict:
        """The costs the objectives read, measured once per architecture (engine/costs.py)
        when the model is proposed, before it trains: a constraint on them rules it out
        there; they are kept until the model's trial ends. ``{}``: none needed."""
        from .costs import needed_costs

        if not needed_costs(self.objectives.needed, self.costs):
            return {}
        return self._cost_meter().measure(model, structure)

    def _model_costs(self, model_id: int | None) -> dict:
        """The measured costs of a model whose trial ended (after a resume: from the store's
        cache, measured again when missing)."""
        from .costs import needed_costs

        if model_id is None or not needed_costs(self.objectives.needed, self.costs):
            return {}
        if model_id not in self._costs:
            row = self.store.get_model(model_id)
            model = self.search_space.instantiate(row["sample"])
            self._costs[model_id] = self._cost_meter().measure(model, row["hash"])
        return self._costs.pop(model_id)

    def _end_model(self, trial: Trial) -> None:
        sample, model_id = trial.config.get("choices"), trial.config.get("model_id")
        outcome = self._outcomes.judge(trial.last_result or {}, self._model_costs(model_id))
        value = outcome.value
        if trial.state is not TrialState.ERRORED and outcome.error is not None \
                and "not a finite number" in outcome.error:
            # NaN or inf (a diverged model, a broken metric) ranks nowhere: the model failed.
            _log.warning("trial %s ended with %s: its model is recorded as failed",
                         trial.trial_id, outcome.error)
        failed = trial.state is TrialState.ERRORED or value is None
        error = None
        if failed:  # kept with the model: `retiarii status` says why
            error = trial.error if trial.state is TrialState.ERRORED else outcome.error
            value = None
        if model_id is not None:
            self.store.set_model_status(
                model_id, ModelStatus.FAILED if failed else ModelStatus.TRAINED, value,
                error=error or ("(no reason recorded)" if failed else None))
            if self._outcomes.extended and not failed:
                table = FrontTable(self.store)
                table.set_values(model_id, outcome.values, outcome.violation)
                if self._outcomes.add_to_front(model_id, outcome):
                    table.set_front(self._outcomes.front.members)
        told, violation = (None, 0.0) if failed else (outcome.told, outcome.violation)
        if sample is not None:
            key = None
            if model_id is not None:
                # The key computed when it was proposed (saves reading the model's graph back);
                # a model of an earlier run (resume) takes its hash from the store.
                key = self._keys.pop(model_id, None)
                if key is None:
                    key = self._dedup_key(self.store.get_model(model_id)["hash"], sample)
            if key is not None:
                self._known[key] = (told, violation)
            try:
                self._tell(sample, told, violation)
            except UnknownSample:
                pass  # not proposed by the restored strategy (yet): told when it proposes it
            self._save_strategy()
