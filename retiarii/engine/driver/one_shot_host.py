"""The engine's host of one-shot (weight-sharing) searches: one job per segment, every fact in
SQLite, a killed search resumed from its last unit.

A :class:`~retiarii.strategies.one_shot.OneShot` strategy trains many models on shared weights
and finally selects one architecture. The driver never trains it: each segment is a job for
the experiment's executor (local processes or Ray), whose worker rebuilds the strategy from
its class and ``config()``, sets it up on the space and trainer exactly as for trials, loads
the last **unit** (the file that holds its whole state after a segment), runs the segment and
writes the next unit (:mod:`.one_shot_worker`). The driver then records, in one transaction,
the models the segment evaluated and the segment as done with its unit (:mod:`.segments`):
a driver killed at any point loses at most the segment in flight, and never records a model
twice. A worker lost mid-segment (killed, out of memory, an I/O error) is retried from the
last unit, up to ``max_failures`` times; a failure of the strategy itself (a space it cannot
handle) is recorded as the experiment's error and the experiment is marked failed. After the
last segment the strategy's selected architecture becomes the experiment's result model,
exported by ``retiarii export`` with the weights it inherits when the strategy offers
``export_state(sample)``.

Example::

    exp = rt.Experiment(space, rt.strategies.DARTS(epochs=10), rt.Trainer(dataset="digits"),
                        store="runs/darts.db")
    exp.run()                      # kill it any time: exp.resume() / `retiarii resume`
    # Experiment(space, rt.strategies.Random(seed=0), ..., weight_sharing=True): the
    # multi-trial strategy samples the models of a weight-sharing super-network

:class:`Experiment` hands its one-shot runs to :func:`host` (a :class:`OneShotRun` to its
end); :func:`check_options` refuses the options a one-shot search cannot honour, naming each.
"""
from __future__ import annotations

import logging
import time
import warnings
from typing import Any

from ...strategies.one_shot.base import OneShot
from ..errors import EnvironmentFailure, ExperimentError, stopped
from ..jobs.job import (
    FailureKind, Job, JobFailed, JobFinished, SegmentDone, TrialCheckpointed, TrialTask,
)
from ..worker_side.one_shot_segment import build_strategy, strategy_spec
from ..storage.segments_table import SegmentTable, finite

__all__ = ["OneShotRun", "host", "SelectionWarning", "check_options", "wrap_weight_sharing", "one_shot_spec"]

_log = logging.getLogger("retiarii.engine")


def wrap_weight_sharing(strategy: Any, trainer: Any, error: type[Exception],
                        weight_sharing: Any = True) -> Any:
    """``strategy`` (multi-trial) wrapped by :class:`retiarii.strategies.WeightSharing`, which
    trains the models it proposes on one super-network's shared weights, for the trainer's
    epochs (one segment each); ``weight_sharing``: True (every operator shared) or the module
    path patterns of the shared operators."""
    if weight_sharing is not True and (isinstance(weight_sharing, (bool, str)) or
                                       not isinstance(weight_sharing, (list, tuple))):
        raise error(f"weight_sharing={weight_sharing!r}: give True, False, or a list of the "
                    f"module path patterns whose weights are shared, e.g. ['stem', 'cells.*']")
    shared = None if weight_sharing is True else list(weight_sharing)
    if isinstance(strategy, OneShot):
        raise error(f"weight_sharing=True wraps a multi-trial strategy, but "
                    f"{type(strategy).__name__} is already a one-shot strategy: drop "
                    f"weight_sharing")
    try:
        from ...strategies import WeightSharing  # lazily: the one-shot machinery is heavy
    except ImportError as err:
        raise error(f"weight_sharing=True needs retiarii.strategies.WeightSharing, which "
                    f"this installation lacks ({err}): upgrade retiarii, or run the strategy "
                    f"multi-trial (weight_sharing=False)") from None
    try:
        return WeightSharing(strategy, segments=int(trainer.num_epochs({})), shared=shared)
    except ValueError as e:
        raise error(str(e)) from None


def check_shared(strategy: Any, space: Any, error: type[Exception]) -> None:
    """The strategy's ``shared`` patterns (the operators that share weights) each match an
    operator of ``space``, or ``error`` naming the culprit, before any work starts."""
    shared = getattr(strategy, "shared", None)
    if shared is None:
        return
    from ...optim.supergraph import SuperGraph, SuperGraphError

    try:
        SuperGraph(space, shared=shared)
    except SuperGraphError as e:
        raise error(f"{type(strategy).__name__}: {e}") from None


def check_device_memory(strategy: Any, memory: Any, one_shot: bool,
                        error: type[Exception]) -> float | None:
    """``device_memory`` in bytes (None stays None), or ``error`` naming why it cannot be:
    not a size, a multi-trial search, or a strategy that cannot split its super-graph."""
    if memory is None:
        return None
    from ...optim.split import parse_bytes

    try:
        memory = parse_bytes(memory)
    except ValueError as e:
        raise error(str(e)) from None
    name = type(strategy).__name__
    if not one_shot:
        raise error(f"device_memory applies to one-shot searches (a super-graph split over "
                    f"devices); {name} trains separate models: leave it out")
    if not callable(getattr(strategy, "limit_memory", None)):
        raise error(f"device_memory: {name} cannot split its shared weights over devices "
                    f"(SPOS, ENAS and WeightSharing can); leave device_memory out")
    return memory


def check_options(strategy: Any, error: type[Exception], **given: Any) -> None:
    """Refuse what a one-shot search cannot honour, naming the option and the fix. ``given``
    holds the Experiment's arguments that only multi-trial searches use, as given."""
    name = type(strategy).__name__
    refused = {
        "scheduler": (given.get("scheduler") is not None,
                      "a one-shot search trains one super-network: no trial to stop early"),
        "optimize": (given.get("optimize") in (True, "pack"),
                     "cross-model optimization merges and packs separate trials; a one-shot "
                     "search shares weights already"),
        "packing": (given.get("packing") is True, "packing places separate trials on devices"),
        "dedicated": (bool(given.get("dedicated")),
                      "a dedicated device runs the frozen part that grouped trials share"),
        "fuse": (given.get("fuse") not in (False, None), "fusion merges separate trials"),
        "batching": (bool(given.get("batching")), "batching merges separate trials"),
        "passes": (any(v not in (False, None) for v in (given.get("passes") or {}).values()),
                   "the plan passes merge separate trials"),
        "max_models": (given.get("max_models") is not None,
                       "the strategy's segments decide how many models it evaluates"),
        "model_retries": (bool(given.get("model_retries")),
                          "a strategy's own failure is deterministic and fails the search"),
    }
    bad = [(option, why) for option, (hit, why) in refused.items() if hit]
    if bad:
        option, why = bad[0]
        raise error(f"{option}={given[option]!r} does not apply to the one-shot strategy "
                    f"{name} ({why}); leave {option} out")
    executor = given.get("executor")
    from ..executors.simulated import SimulatedExecutor

    if isinstance(executor, SimulatedExecutor):
        raise error("the SimulatedExecutor fakes training and cannot run one-shot segments: "
                    "use the local executor or Ray")
    spec = strategy_spec(strategy)
    try:
        again = build_strategy(spec)
    except Exception as err:  # noqa: BLE001 (what a worker would meet, said now)
        raise error(f"{name} cannot be rebuilt from its class and config() {spec['config']} "
                    f"as workers rebuild it ({type(err).__name__}: {err}); make config() "
                    f"return its constructor's keyword arguments") from None
    if type(again) is not type(strategy) or again.config() != strategy.config():
        raise error(f"{name} rebuilt from config() {spec['config']} has config() "
                    f"{again.config()}: make config() return its constructor's arguments")


class HeldHyperParameters(UserWarning):
    """A one-shot search trains its super-network with the trainer's searched
    hyper-parameters held at their defaults; retraining the selection searches them."""


def held_hparams(trainer_hparams: dict) -> dict:
    """The trainer's ValueChoice settings at the values a one-shot search holds them at: each
    choice's first value (name a value by giving the trainer that plain value instead)."""
    return {name: choice.default for name, choice in trainer_hparams.items()}


def warn_held(strategy: Any, held: dict) -> None:
    """Say once, at the start of a one-shot search, which trainer hyper-parameters it holds."""
    if held:
        values = ", ".join(f"{k}={v!r}" for k, v in held.items())
        warnings.warn(f"the one-shot strategy {type(strategy).__name__} trains one "
                      f"super-network with one set of hyper-parameters: the trainer's "
                      f"searched {sorted(held)} are held at {values} during the search; "
                      f"`retiarii retrain DB --model ID` searches them for the selected "
                      f"architecture", HeldHyperParameters, stacklevel=3)


def one_shot_spec(strategy: OneShot) -> dict:
    """The strategy as an experiment's config records it (resume compares it)."""
    return {**strategy_spec(strategy), "one_shot": True, "segments": int(strategy.num_segments())}


class OneShotRun:
    """Run (or resume) the one-shot search of ``exp`` on ``executor`` (see the module
    docstring). ``exp`` is an :class:`~.experiment.Experiment` whose store is open."""

    def __init__(self, exp, executor):
        self.exp, self.executor = exp, executor
        self.store = exp.store
        self.table = SegmentTable(self.store)
        self.segments = int(exp.strategy.num_segments())
        self.trial_id = f"e{self.store.experiment_id}-one-shot"
        self.spec = {"space": exp.space_ref, "trainer": exp.trainer_spec,
                     "hparams": held_hparams(exp.trainer.value_choices()),
                     "seed": exp.seed, "strategy": strategy_spec(exp.strategy),
                     "segments": self.segments}
        if exp.ranks > 1:
            self.spec["ranks"] = exp.ranks
        if exp.deterministic:  # the worker (and its ranks) train in deterministic mode
            self.spec["deterministic"] = True
        if exp.device_memory is not None:
            self.spec["device_memory"] = exp.device_memory
        frozen = exp.space.frozen_fingerprint()
        if frozen is not None:
            self.spec["frozen"] = frozen

    def run(self, deadline: float | None) -> tuple[str, str]:
        """Segments until the last, then the result. Returns (how it ended, why):
        ``"done"``; ``"stopped"`` when ``deadline`` (``time.monotonic()``) passed between
        segments; ``"environment"`` when a segment's environment kept failing (resumable);
        ``"failed"`` when the strategy failed (recorded as the experiment's error)."""
        last = self.table.last()
        done, unit = (last["segment"], last["unit"]) if last else (0, None)
        if self.table.error() is not None:
            self.table.clear_error()  # resumed after a failure: the segment is tried again
        failures = 0
        while done < self.segments:
            if deadline is not None and time.monotonic() >= deadline:
                return "stopped", f"max_time passed after segment {done}"
            events = self._segment(done, unit, failures)
            end = events[-1]
            if isinstance(end, JobFinished):
                unit = self._commit(events, unit)
                done, failures = done + 1, 0
                continue
            assert isinstance(end, JobFailed)
            reason = (end.error or "").strip()
            if end.kind is FailureKind.ENVIRONMENT and failures < self.exp.max_failures:
                failures += 1
                _log.warning("one-shot segment %d failed (%s); retrying from %s (%d of %d)",
                             done + 1, reason.splitlines()[0] if reason else "?",
                             unit or "the start", failures, self.exp.max_failures)
                continue
            if end.kind is FailureKind.ENVIRONMENT:
                return "environment", (f"one-shot segment {done + 1} failed {failures + 1} "
                                       f"times (last: {_first_line(reason)})")
            self.table.fail(reason)
            return "failed", (f"the one-shot search failed in segment {done + 1}: "
                              f"{_first_line(reason)}")
        if self.table.result() is None:
            return self._record_result()
        return "done", ""

    # ---- one segment ----------------------------------------------------------------------
    def _segment(self, done: int, unit: str | None, attempt: int) -> list:
        """Submit segment ``done`` (0-based) and collect its events up to the terminal one."""
        folder = self.exp.folder
        out = folder.name_for(self.trial_id, done + 1)
        task = TrialTask(self.trial_id, self.spec, done, done + 1,
                         checkpoint_in=None if unit is None else folder.path(unit),
                         checkpoint_out=folder.path(out))
        job = Job(f"{self.trial_id}-s{done + 1}-a{attempt}", [task], attempt=attempt,
                  meta={"one_shot": True, "unit": out})
        self._submit(job)
        events = []
        while True:
            event = self.executor.next_event()
            if event is None:  # no timeout was given: the executor has nothing left to run
                events.append(JobFailed(job.job_id, None, "the executor dropped the segment's "
                                        "job", kind=FailureKind.ENVIRONMENT))
                break
            if event.job_id != job.job_id:
                continue
            events.append(event)
            if isinstance(event, (JobFinished, JobFailed)):
                break
        if isinstance(events[-1], JobFinished) and not (
                any(isinstance(e, SegmentDone) for e in events)
                and any(isinstance(e, TrialCheckpointed) for e in events)):
            events.append(JobFailed(job.job_id, self.trial_id, "the segment's job finished "
                                    "without reporting its result and unit",
                                    kind=FailureKind.ENVIRONMENT))
        return events

    def _submit(self, job: Job) -> None:
        self.executor.submit(job)

    def _commit(self, events: list, previous: str | None) -> str:
        """Record the segment and its models in one transaction; drop the unit before it."""
        done = next(e for e in events if isinstance(e, SegmentDone))
        path = next(e for e in events if isinstance(e, TrialCheckpointed)).path
        unit = self.exp.folder.name(path)
        self.table.commit(done.segment, unit, done.metrics, done.selected, list(done.models),
                          metric=self.exp.metric, seconds=done.seconds)
        if previous is not None and previous != unit:
            try:  # nothing reads it again; a failure to delete costs disk only
                self.exp.folder.remove(previous)
            except OSError as err:
                _log.warning("could not delete the one-shot unit %s: %s", previous, err)
        if self.exp.progress is not None:
            self.exp.progress(self.exp.summary())
        return unit

    def _record_result(self) -> tuple[str, str]:
        """The selected architecture of the last segment becomes the experiment's result."""
        selected = self.table.last()["selected"]
        try:
            model = self.exp.space.replay(selected)
        except Exception as err:  # noqa: BLE001 (the strategy selected a sample of no model)
            reason = (f"{type(self.exp.strategy).__name__}.selected() gave {selected}, which "
                      f"the space cannot rebuild ({type(err).__name__}: {err})")
            self.table.fail(reason)
            return "failed", reason
        value = None
        for row in reversed(self.table.evaluated()):  # its latest evaluation, if any
            if row["sample"] == selected:
                value = finite(row["value"])
                break
        self.table.record_result(selected, model.graph.to_data(), model.structural_hash(), value)
        # a selection no better than chance, or tied: said to a Python user too (status and
        # the run's output say it as well; selection_notes.py)
        for text in self.table.summary(None, self.exp.mode)["warnings"]:
            warnings.warn(f"{self.exp.path}: {text}", SelectionWarning, stacklevel=2)
        return "done", ""


def host(exp: Any, executor: Any, resume: bool) -> dict:
    """Host experiment ``exp``'s one-shot strategy (a :class:`OneShotRun`) to its end, the
    experiment's status kept in its store; returns its summary. ``executor`` is closed unless
    it is the one the user gave."""
    started = time.monotonic()
    exp._deadline = None if exp.max_time is None else started + exp.max_time
    exp.store.set_experiment_status("running")
    try:
        if resume:
            exp.folder.remove_temporaries()  # half-written by workers killed with us
        try:
            status, why = OneShotRun(exp, executor).run(exp._deadline)
        except EnvironmentFailure as err:  # the executor can no longer run anything
            status, why = "environment", str(err)
        if status == "environment":
            exp.store.set_experiment_status("stopped")
            raise stopped(exp.path, why)
        if status == "failed":  # the store already says failed, and why
            raise ExperimentError(f"{exp.path}: {why} (recorded: retiarii status {exp.path})")
        exp.store.set_experiment_status(status)
    except KeyboardInterrupt:
        exp.store.set_experiment_status("interrupted")
        raise
    finally:
        if executor is not exp.executor:  # made here (None or "ray"): ours to close
            executor.close()
        exp.store.flush()
    return exp.summary()


class SelectionWarning(UserWarning):
    """A one-shot search's selected architecture is no better than chance, or ties others."""


def _first_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0] if lines else "(no reason given)"
