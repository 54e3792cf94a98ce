"""The worker's half of a one-shot search: rebuild the strategy, run one segment, save its unit.

A one-shot segment travels as an ordinary :class:`~.executors.base.Job` whose
``meta["one_shot"]`` is true and whose one task carries, besides the trial spec's ``space``,
``trainer``, ``hparams`` and ``seed``, the strategy to rebuild (``{"class": ref, "config":
{...}}``, :func:`strategy_spec`) and the number of segments. ``task.start_step`` is the segment
to run (0-based: segments already done), ``task.checkpoint_in`` the unit written after the
previous one (None for the first), ``task.checkpoint_out`` where the new unit goes. Any
executor that runs :func:`retiarii.engine.worker_side.worker.run_job` runs it (local processes, Ray).

:func:`retiarii.engine.worker_side.worker.run_job` hands such a job to :func:`open_segment`, which seeds
the RNG streams from the spec's seed, builds the strategy and calls ``setup`` exactly as every
segment does, and loads the unit (the strategy's ``state_dict()`` and the RNG states it was
saved with); then to :func:`finish_segment`, which runs ``run_segment`` and writes the new unit
atomically (:func:`~.checkpoint.save`): ``{"segment", "strategy", "rng"}`` plus, after the last
segment, ``"export"`` (the selected sample and, when the strategy offers
``export_state(sample)``, the weights it inherits). Since every segment starts from a unit,
one rerun from the same unit (a killed worker, a resumed driver) gives the same result.

Events: ``JobStarted``; ``SegmentDone`` (metrics, evaluated models, selected architecture);
``TrialCheckpointed`` (the unit); ``JobFinished`` -- or ``JobFailed`` with the error and its
kind (:func:`~.worker.classify_error`) when anything raised, and nothing written.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from ...refs import ref_of, resolve_ref
from ...strategies.one_shot.base import EvaluatedModel, OneShot, SegmentContext, SegmentResult
from ..storage import checkpoint
from ..jobs.job import (
    Event, Job, JobFailed, JobFinished, SegmentDone, TrialCheckpointed,
)

__all__ = ["strategy_spec", "build_strategy", "open_segment", "finish_segment",
           "run_ranked_segment", "UnitError"]


class UnitError(checkpoint.CheckpointError):
    """A unit that is not the one the segment needs (another segment's, or not a unit)."""


def _is_spec(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"class", "config"} \
        and isinstance(value["class"], str)


def strategy_spec(strategy: Any) -> dict:
    """``{"class": ref, "config": strategy.config()}``: what a worker rebuilds ``strategy``
    from. A config value that is itself a strategy object (a wrapper's inner strategy) may be
    given as such a spec, nested; :func:`build_strategy` rebuilds it first."""
    return {"class": ref_of(type(strategy)), "config": strategy.config()}


def build_strategy(spec: dict) -> Any:
    """The strategy ``spec`` (:func:`strategy_spec`) describes: its class called with its
    config as keyword arguments, nested specs rebuilt into objects."""
    cls = resolve_ref(spec["class"])
    config = {k: build_strategy(v) if _is_spec(v) else v for k, v in spec["config"].items()}
    return cls(**config)


def _models(result: Any, strategy: Any) -> tuple[dict, ...]:
    name = type(strategy).__name__
    if not isinstance(result, SegmentResult):
        raise TypeError(f"{name}.run_segment returned a {type(result).__name__}, not a "
                        f"SegmentResult; return SegmentResult(metrics, models)")
    out = []
    for i, model in enumerate(result.models):
        if not isinstance(model, EvaluatedModel) or not isinstance(model.sample, dict):
            raise TypeError(f"{name}.run_segment: models[{i}] is {model!r}; give "
                            f"EvaluatedModel(sample: dict, metrics: dict)")
        out.append({"sample": dict(model.sample), "metrics": _numbers(model.metrics, name)})
    return tuple(out)


def _numbers(metrics: Any, name: str) -> dict:
    if not isinstance(metrics, dict):
        raise TypeError(f"{name}: metrics must be a dict of numbers, got {metrics!r}")
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, (int, float)):
            raise TypeError(f"{name}: metric {key!r} is {value!r}, not a number; report "
                            f"plain numbers (call .item() on a tensor)")
        out[str(key)] = float(value)
    return out


def _device() -> torch.device:
    # The executor gave this process its GPU (CUDA_VISIBLE_DEVICES): use it when there is one.
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _setup(spec: dict, context, device: torch.device | None = None
           ) -> tuple[OneShot, Any, dict, torch.device]:
    """The strategy of ``spec``, built and set up (from the spec's seed) as every segment's
    (on ``device``, by default the worker's)."""
    for key in ("space", "trainer", "strategy"):
        if key not in spec:
            raise KeyError(f"a one-shot task's spec lacks {key!r} (see "
                           f"retiarii.engine.worker_side.one_shot_segment)")
    space, trainer = context.space(spec["space"]), context.trainer(spec["trainer"])
    if "frozen" in spec:
        space.check_frozen(spec["frozen"])
    hparams = spec.get("hparams") or {}
    strategy = build_strategy(spec["strategy"])
    if not isinstance(strategy, OneShot):
        raise TypeError(f"{spec['strategy']['class']} is not a OneShot strategy")
    device = device or _device()
    checkpoint.seed_rng(int(spec.get("seed") or 0))  # the shared weights' initial values
    strategy.setup(space, trainer, hparams, device)
    return strategy, trainer, hparams, device


def _limit(strategy: OneShot, spec: dict) -> None:
    """A device budget for the shared weights, before any state is loaded."""
    if spec.get("device_memory") is not None:
        from ...optim.mixed_parallel import limit_memory

        limit_memory(strategy, float(spec["device_memory"]))


def _open(task, context, device: torch.device | None = None
          ) -> tuple[OneShot, Any, dict, torch.device]:
    """The strategy of ``task``, set up and at the start of segment ``task.start_step``."""
    strategy, trainer, hparams, device = _setup(task.spec, context, device)
    _limit(strategy, task.spec)
    if task.checkpoint_in is not None:
        # to the CPU, as trial checkpoints load: RNG states must stay CPU ByteTensors, and
        # load_state_dict copies the rest onto the strategy's own device
        unit = checkpoint.load(task.checkpoint_in, map_location="cpu")
        if not isinstance(unit, dict) or unit.get("segment") != task.start_step:
            raise UnitError(f"unit {task.checkpoint_in} holds segment "
                            f"{unit.get('segment') if isinstance(unit, dict) else '?'}, not "
                            f"{task.start_step}: it is not the unit this segment starts from")
        strategy.load_state_dict(unit["strategy"])
        checkpoint.restore_rng(unit["rng"])
    elif task.start_step != 0:
        raise UnitError(f"segment {task.start_step} of task {task.trial_id} has no unit to "
                        f"start from")
    return strategy, trainer, hparams, device


def _plain_leaf(obj: Any) -> Any:
    for plain in (str, int, float):
        if isinstance(obj, plain) and type(obj) is not plain and type(obj) is not bool:
            return plain.__new__(plain, obj)
    return obj


def _plain(obj: Any) -> Any:
    """``obj`` with every str, int and float subclass (a ``Mode``, an ``IntEnum``) made the
    plain type: ``torch.load(weights_only=True)`` cannot rebuild their classes, and a state
    that the store keeps as JSON reads them back as plain values anyway."""
    return checkpoint.map_leaves(obj, _plain_leaf)


def _unit(strategy: OneShot, segment: int, last: bool, rng: dict) -> dict:
    unit = {"segment": segment, "strategy": _plain(strategy.state_dict()), "rng": rng}
    if last:
        selected = strategy.selected()
        export = {"sample": selected}
        if callable(getattr(strategy, "export_state", None)):
            export["weights"] = {k: v.detach().cpu() for k, v in
                                 strategy.export_state(selected).items()}
        unit["export"] = export
    return unit


def _rank_build(spec: dict, segment: int, rng: dict | None,
                new_context: Any) -> tuple[OneShot, SegmentContext]:
    """One rank's strategy and context for a segment on several ranks: built as every segment
    builds it, with the RNG states of the unit (the state itself is loaded by
    :func:`~retiarii.engine.executors.local_ranks.run_segment_on_ranks`)."""
    strategy, trainer, hparams, device = _setup(spec, new_context())
    if rng is not None:
        checkpoint.restore_rng(rng)
    return strategy, SegmentContext(segment, trainer, hparams, device,
                                    device_memory=spec.get("device_memory"))


def _on_ranks(task, context, ranks: int) -> tuple[OneShot, SegmentResult, dict]:
    """Run the segment of ``task`` on ``ranks`` ranks (mixed parallelism): the strategy here
    (set up and loaded with rank 0's new state), the segment's result, and the RNG states the
    unit keeps (those the ranks started from: each segment's ranks start from its unit)."""
    import functools

    from ..executors.local_ranks import run_segment_on_ranks

    # set up, and the unit loaded (checked) if any: on the CPU, the ranks hold the devices
    strategy, *_ = _open(task, context, torch.device("cpu"))
    state = None if task.checkpoint_in is None else strategy.state_dict()
    rng = checkpoint.capture_rng()  # where every rank starts
    # the ranks build their own strategy with a context like this process's (its class
    # travels pickled by reference)
    build = functools.partial(_rank_build, task.spec, task.start_step, rng, type(context))
    runner = getattr(context, "run_ranks", None)  # the executor's way to run ranks, if any
    if runner is not None:
        # (the search goes on after this segment: the executor may keep the ranks for it)
        more = task.stop_step < int(task.spec.get("segments") or task.stop_step)
        result, new_state = runner(build, state, ranks, keep=more)
    else:  # K local processes
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        backend = "nccl" if gpus >= ranks else "gloo"  # NCCL needs a GPU per rank
        result, new_state = run_segment_on_ranks(build, state, ranks, backend=backend)
    strategy, *_ = _setup(task.spec, context, torch.device("cpu"))
    _limit(strategy, task.spec)
    strategy.load_state_dict(new_state)
    return strategy, result, rng


def open_segment(task, context) -> tuple[OneShot, SegmentContext]:
    """The strategy of ``task``, set up and loaded at the start of its segment, and the
    segment's context (raises what building or loading raised)."""
    strategy, trainer, hparams, device = _open(task, context)
    return strategy, SegmentContext(task.start_step, trainer, hparams, device,
                                    device_memory=task.spec.get("device_memory"))


def finish_segment(job: Job, strategy: OneShot, ctx: SegmentContext,
                   started: float) -> list[Event]:
    """Run the segment, write its unit, and return the events that report it (raises what
    the strategy or the disk raised; nothing is written then)."""
    result = strategy.run_segment(ctx)
    if ctx.should_stop():  # the segment may have stopped early: it is not done
        return [JobFailed(job.job_id, None, "cancelled")]
    return _report(job, strategy, result, started, checkpoint.capture_rng())


def run_ranked_segment(job: Job, context, started: float) -> list[Event]:
    """:func:`finish_segment` for a task whose spec asks for ``ranks`` > 1: the segment runs
    on that many ranks (:mod:`retiarii.optim.mixed_parallel`), each rank training its own
    sampled model on its share of the batches."""
    task = job.tasks[0]
    strategy, result, rng = _on_ranks(task, context, int(task.spec["ranks"]))
    return _report(job, strategy, result, started, rng)


def _report(job: Job, strategy: OneShot, result: Any, started: float, rng: dict) -> list[Event]:
    """Write the unit after the segment and return the events that report it."""
    task = job.tasks[0]
    name = type(strategy).__name__
    models, metrics = _models(result, strategy), _numbers(result.metrics, name)
    segment = task.stop_step
    selected = strategy.selected()
    if not isinstance(selected, dict):
        raise TypeError(f"{name}.selected() returned {selected!r}, not a sample dict")
    last = segment >= int(task.spec.get("segments") or segment)
    checkpoint.save(task.checkpoint_out, _unit(strategy, segment, last, rng))
    return [SegmentDone(job.job_id, task.trial_id, segment, metrics, models, dict(selected),
                        time.perf_counter() - started),
            TrialCheckpointed(job.job_id, task.trial_id, segment, task.checkpoint_out),
            JobFinished(job.job_id)]
