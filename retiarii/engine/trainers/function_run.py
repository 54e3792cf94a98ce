"""One trial of a :class:`~.function_trainer.FunctionTrainer`: the user's loop, run one segment
at a time in a worker, as a :class:`~.trial_run.TrialRun` is.

NOTE: [Function segments]
The engine trains a trial in segments (a job trains steps ``(start, stop]`` and checkpoints at
``stop``), and the user's function is a loop of its own. Two ways to fit them were weighed:

* keep the function alive across segments (park it in ``report`` until the driver says
  continue), resuming from a file only after a pause or a crash; or
* **end the function at the segment's last step and start it again, from ``session.load()``,
  in the next segment.** This module does this.

The second makes the checkpoint the only thing that crosses a segment boundary, for every
trial and whichever worker runs the next segment: an uninterrupted trial and one paused,
resumed on another worker, exploited by PBT or retried after a lost worker run the same code
from the same file, so they are equal by construction, not by a second code path that must be
kept in step with the first. A function that saves too little then shows it at once (its
results change with the segment length), not only after a rare crash. A parked function would
also hold its model's memory on a worker that meanwhile trains other trials. The price is that
the function's own setup (building an optimizer, opening its data) runs once per segment, as
the engine already rebuilds a :class:`~.trial_run.TrialRun` per segment.

Within a segment the function runs in a thread of the worker, handing over each new step's
metrics: the worker's job loop asks for one step at a time (:meth:`FunctionRun.train_epoch`),
emits its result, and may cancel the job between steps, exactly as for a ``Trainer``. The two
threads never run at once (a semaphore hands the turn over), so the trial's RNG streams are
swapped in around each step as for a ``TrialRun``.

What a checkpoint holds: the state of the function's last ``session.save`` (snapshotted when it
was called), the python/numpy/torch RNG streams at that moment (``session.load()`` puts them
back), and the step the engine had reached. A function restarted from a state older than that
step (it saved every few steps, or after ``report``) replays the steps in between: their
reports are checked for order and otherwise ignored, so the engine sees each step once.
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable

import torch
from torch import nn

from ..storage import checkpoint as ckpt
from ...rng import swapped_in
from .trial_training import TrainingError

__all__ = ["FunctionRun", "Session", "snapshot"]

_log = logging.getLogger("retiarii.engine")

KIND = "function"  # a function trial's checkpoint says so: a TrialRun's checkpoint is refused

# What torch.load(weights_only=True) reads back (engine/checkpoint.py accepts the same).
_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


class _SegmentEnd(BaseException):
    """Raised in the function by ``report`` to end it (the segment is done, or the job is
    cancelled). A BaseException, as GeneratorExit: a loop's ``except Exception`` lets it by."""


def snapshot(state: Any, where: str = "state") -> Any:
    """A copy of ``state`` that later training cannot change: tensors cloned onto the CPU
    (where a checkpoint is read back anyway), containers rebuilt, plain values kept.

    Example::

        saved = snapshot({"model": model.state_dict(), "epoch": 3})

    Raises:
        TypeError: naming the first value (by its path) that a checkpoint cannot hold.
    """
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, _PLAIN):
        return state
    if isinstance(state, dict):
        out = type(state)()
        for key, value in state.items():
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise TypeError(f"session.save: {where} has a key of type {type(key).__name__}; "
                                f"use strings or numbers as keys")
            out[key] = snapshot(value, f"{where}[{key!r}]")
        if hasattr(state, "_metadata"):  # a module's state_dict: load_state_dict reads it
            out._metadata = dict(state._metadata)
        return out
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v, f"{where}[{i}]") for i, v in enumerate(state))
    raise TypeError(
        f"session.save: {where} is a {type(state).__module__}.{type(state).__qualname__}, which "
        f"a checkpoint cannot hold (it is read with torch.load(weights_only=True)); save its "
        f"state_dict() or plain values: tensors, numbers, strings, lists and dicts")


class Session:
    """What the training function talks to: ``report``, ``save``, ``load``.

    Example::

        def train(model, hparams, session):
            opt = torch.optim.SGD(model.parameters(), lr=hparams["lr"])
            state = session.load()          # None on a fresh start
            start = 0
            if state is not None:
                model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
                start = state["epoch"]
            for epoch in range(start, hparams["epochs"]):
                ...                          # train and validate one epoch
                session.save({"model": model.state_dict(), "opt": opt.state_dict(),
                              "epoch": epoch + 1})
                session.report(epoch + 1, val_acc=acc)

    Attributes:
        trial_id: the trial's id.
        device: where the worker trains (a GPU when it has one); the model is already there.
    """

    def __init__(self, run: "_Shared"):
        self._run = run
        self.trial_id, self.device = run.trial_id, run.device

    def report(self, step: int, **metrics: Any) -> None:
        """Record the metrics of ``step`` (1-based: the steps, usually epochs, done so far);
        the schedulers count in these steps. Returns when the engine wants the next step; at
        the end of a segment, or when the trial is stopped or paused, it ends the function
        (by an exception that ``except Exception`` does not catch), so save before reporting.

        Args:
            step: one more than the last step reported (steps the loaded state had already
                done may be reported again: they are replayed, and ignored).
            metrics: numbers (or one-element tensors), e.g. ``val_acc=0.93``.
        """
        self._run.report(step, metrics)

    def save(self, state: Any) -> None:
        """Keep ``state`` (a dict of tensors, numbers, strings, lists, dicts: state_dicts of the
        model, optimizers and LR schedulers, your position, your own generators' states) as
        the trial's checkpoint; the python, numpy and torch RNG streams are kept with it. It
        is copied now, so training on changes nothing saved. Call it before ``report``."""
        self._run.save(state)

    def load(self) -> Any:
        """The state to start from: this trial's last saved one when it resumes, its parent's
        under PBT (with this trial's new ``hparams``: apply them after loading), or None on a
        fresh start. Also puts back the RNG streams as they were when that state was saved,
        so call it right before your loop."""
        return self._run.load()


class _Shared:
    """What the function's thread and the worker's thread share: the handover and the
    trial's position. Kept apart from :class:`FunctionRun` so that the thread holds no
    reference to the run (a run that is dropped can then end its thread)."""

    def __init__(self, trial_id: str, device: torch.device, done: int, stop: int,
                 state: Any, rng: Any):
        self.trial_id, self.device = trial_id, device
        self.done, self.stop = done, stop  # steps the engine has; this segment's last step
        self.state, self.rng = state, rng  # the last save: a snapshot and its RNG streams
        self.saved_since_report = False  # a save of this function run since its last report
        self.last = 0  # the last step the function reported (replays included)
        self.to_function = threading.Semaphore(0)  # the function's turn
        self.to_worker = threading.Semaphore(0)  # the worker's turn
        self.message: tuple = ()  # what the function hands over: result, error, returned
        self.aborted = False
        self.warned = False

    # -- the function's side ------------------------------------------------------------------
    def report(self, step: Any, metrics: dict) -> None:
        if self.aborted:
            raise _SegmentEnd()
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise TypeError(f"session.report(step={step!r}): the step is the number of steps "
                            f"(epochs) done so far, an int >= 1, e.g. report(epoch + 1, ...)")
        if step <= self.last:
            raise ValueError(f"session.report(step={step}) after step {self.last}: report each "
                             f"step once, in order")
        values = _metrics(step, metrics)
        self.last = step
        if step <= self.done:  # replayed from an older state: the engine has this step
            return
        if step != self.done + 1:
            raise ValueError(
                f"session.report(step={step}) skips steps: trial {self.trial_id} is at step "
                f"{self.done}, so the next report is step {self.done + 1}. Report every step, "
                f"counting from the position your state holds (session.load())")
        if not self.saved_since_report and not self.warned and step == self.stop:
            self.warned = True
            _log.warning("trial %s: session.report(%d) ends the segment but nothing was saved "
                         "since the last report, so the next segment replays from an older "
                         "state; call session.save(...) before session.report(...)",
                         self.trial_id, step)
        self.done = step
        self.saved_since_report = False
        self.message = ("result", step, values)
        if step >= self.stop:  # the segment's last step: end the function now
            self.to_worker.release()
            raise _SegmentEnd()
        self.to_worker.release()
        self.to_function.acquire()
        if self.aborted:
            raise _SegmentEnd()

    def save(self, state: Any) -> None:
        self.state = snapshot(state)
        self.rng = ckpt.portable_rng(ckpt.native_rng())
        self.saved_since_report = True

    def load(self) -> Any:
        if self.rng is not None:
            ckpt.set_native_rng(ckpt.native_from_portable(self.rng))
        return self.state

    # -- the worker's side --------------------------------------------------------------------
    def abort(self, thread: threading.Thread | None) -> None:
        """End a function parked in ``report`` (the job was cancelled or failed)."""
        self.aborted = True
        if thread is not None and thread.is_alive():
            self.to_function.release()
            thread.join(timeout=60)  # its finally blocks run; one that never ends is left


def _metrics(step: int, metrics: dict) -> dict[str, float]:
    if not metrics:
        raise ValueError(f"session.report({step}) gave no metric: report what the scheduler "
                         f"and the strategy judge by, e.g. session.report({step}, val_acc=acc)")
    out = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"session.report({step}, {name}={value!r}): a metric is a number "
                            f"(or a one-element tensor)")
        out[name] = float(value)
    return out


def _body(function: Callable, model: Any, hparams: dict, shared: _Shared) -> None:
    """The function's thread: run it, hand its end over to the worker."""
    shared.to_function.acquire()  # the worker's first train_epoch starts it
    if shared.aborted:
        return
    try:
        function(model, hparams, Session(shared))
        message: tuple = ("returned",)
    except _SegmentEnd:
        return  # the segment's last step (already handed over) or an abort
    except BaseException as err:  # noqa: BLE001 (the trial's failure, raised in the worker)
        message = ("error", err)
    if shared.aborted:
        return
    shared.message = message
    shared.to_worker.release()


class FunctionRun:
    """One segment of a function trial, in the interface a worker drives a
    :class:`~.trial_run.TrialRun` by (``step``, ``train_epoch``, ``save``).

    Example::

        run = FunctionRun(lambda: MyNet(), FunctionTrainer(train, epochs=4), {"lr": 0.1},
                          stop_step=2)
        while run.step < 2:
            print(run.step + 1, run.train_epoch())
        run.save("t1-2.pt")                     # then, perhaps in another process:
        run = FunctionRun(lambda: MyNet(), trainer, {"lr": 0.1}, stop_step=4,
                          checkpoint="t1-2.pt")

    Args:
        build: makes the model (with the trial's RNG seeded), or None: the function gets
            ``model=None`` (a model-free search).
        trainer: the :class:`~.function_trainer.FunctionTrainer`.
        hparams: the trial's hyper-parameters; the trainer's other settings fill the rest.
        stop_step: the segment's last step: ``report`` of that step ends the function.
        seed: seeds the trial's RNG streams on a fresh start.
        checkpoint: resume from this file (the trial's own, or a PBT parent's).
        device: where to train; the first visible GPU when there is one, else the CPU.
        trial_id: names the trial in errors.
    """

    def __init__(self, build: Callable[[], nn.Module] | None, trainer: Any,
                 hparams: dict | None = None, *, stop_step: int, seed: int = 0,
                 checkpoint: str | None = None, device: str | torch.device | None = None,
                 trial_id: str = "trial"):
        self.trainer, self.trial_id = trainer, trial_id
        self.hparams = {**trainer.defaults(), **(hparams or {})}
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.batch = 0  # a function trial is always at a step boundary
        function = trainer.function  # resolved now: a bad reference fails the task at once
        done, state, rng = 0, None, None
        if checkpoint is not None:
            saved = ckpt.load(checkpoint, map_location="cpu")
            if saved.get("kind") != KIND:
                raise ckpt.CheckpointError(f"checkpoint {checkpoint} was not written by a "
                                           f"FunctionTrainer trial; trial {trial_id} cannot "
                                           f"resume from it")
            done, state, rng = int(saved["step"]), saved["state"], saved["rng"]
            if state is not None and saved.get("hparams") != self.hparams:
                _log.info("trial %s starts from a state saved under other hparams (PBT): "
                          "session.load() gives it, the function applies the new ones",
                          trial_id)
        outer = ckpt.native_rng()
        try:
            ckpt.seed_rng(seed)
            model = None
            if build is not None:
                model = build()
                if not isinstance(model, nn.Module):
                    raise TypeError(f"trial {trial_id}: building the model gave a "
                                    f"{type(model).__name__}, not a torch.nn.Module")
                model = model.to(self.device)
            self.model = model
            self._rng = ckpt.native_rng()  # this trial's streams while it is swapped out
        finally:
            ckpt.set_native_rng(outer)
        self._start = done  # the step this segment starts from
        self._shared = _Shared(trial_id, self.device, done, stop_step, state, rng)
        self._thread = threading.Thread(target=_body, name=f"retiarii-function-{trial_id}",
                                        args=(function, model, self.hparams, self._shared),
                                        daemon=True)
        self._thread.start()  # parked until the first train_epoch
        # A run dropped mid-segment (a cancelled job) ends its parked function.
        self._finalizer = weakref.finalize(self, self._shared.abort, self._thread)

    @property
    def step(self) -> int:
        """Steps the engine has of this trial (its checkpoint's, then each one reported)."""
        return self._shared.done

    @property
    def epoch(self) -> int:  # the data position a grouped job's planner reads
        return self._shared.done

    def train_epoch(self) -> dict[str, float]:
        """Let the function run to its next new step's ``report``; that step's metrics.

        Raises:
            whatever the function raised (its traceback kept); :class:`TrainingError` when it
            returned before reaching this segment's last step.
        """
        shared = self._shared
        if not self._thread.is_alive():
            raise TrainingError(f"trial {self.trial_id}: its function already ended")
        with swapped_in(self):
            shared.message = ()
            shared.to_function.release()
            shared.to_worker.acquire()
            kind, *rest = shared.message
            if kind != "result" or rest[0] >= shared.stop:
                # it ends itself (after the segment's last report, or its error or return):
                # let it finish unwinding while its RNG streams are still the ones in
                self._thread.join()
        if kind == "result":
            return rest[1]
        if kind == "error":
            raise rest[0]
        raise TrainingError(self._returned_early())

    def _returned_early(self) -> str:
        shared, name = self._shared, self.trainer.function_name()
        target = self.hparams.get("epochs")
        if shared.last == 0:
            return (f"trial {self.trial_id}: the training function {name} returned without "
                    f"calling session.report(step, **metrics). Report after every step "
                    f"(epoch), e.g. session.report(epoch + 1, val_acc=acc), so the schedulers "
                    f"can decide and the engine can checkpoint")
        if shared.last <= self._start:
            return (f"trial {self.trial_id}: the training function {name} returned after "
                    f"replaying to step {shared.last}, short of step {self._start + 1}: start the "
                    f"loop from the position of session.load()'s state and run it to "
                    f"hparams['epochs'] ({target})")
        return (f"trial {self.trial_id}: the training function {name} returned after step "
                f"{shared.last}, but the engine trains this trial to step {shared.stop}: loop "
                f"until hparams['epochs'] ({target}), or lower FunctionTrainer(epochs=...) / "
                f"the scheduler's max_t")

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint: the last save (and its RNG streams) at the engine's step."""
        state = self._shared.state
        out = {"kind": KIND, "trial_id": self.trial_id, "step": self.step,
               "hparams": self.hparams, "state": state, "rng": self._shared.rng}
        weights = state.get("model") if isinstance(state, dict) else None
        if isinstance(weights, dict):  # `retiarii export` writes a checkpoint's "model"
            out["model"] = weights
        return out

    def save(self, path: str) -> None:
        """Write the checkpoint atomically to ``path``."""
        ckpt.save(path, self.state_dict())

    def close(self) -> None:
        """End the function if it is still parked (the run is dropped mid-segment)."""
        self._finalizer()
