"""The worker's reading of the device model: resolves ``fuse="auto"`` and passes set ``"auto"``.

A grouped job's order says ``fuse`` and each optional pass's setting. The layouts that give
other float rounding than training alone (fused models, batched operators) are decided here
from the models' shapes by :mod:`retiarii.optim.device_model`, before the first step and
without timing anything, so every run of a seeded search makes the same decisions:

- ``fuse="auto"``: each set of trials that may fuse (:func:`~.fused.fusable_sets`) fuses
  when its predicted speed-up reaches :data:`~retiarii.optim.device_model.FUSE_MARGIN`;
  the job then trains those sets fused as under ``fuse=True`` and the others as the layout
  choice says (apart or CSE, which time may choose: bit-identical);
- a pass set ``"auto"`` (``batching``): run when the pass's own test says its plan is worth
  it (``Pass.worth_measuring``: on a CPU, it batches a frozen layer with weights) and the
  models' frozen layers do little enough work per call for the device
  (:func:`~retiarii.optim.device_model.batching_wins`, FLOPs from the first batch's shapes);
- ``"measure"`` is the older rule, handed on as ``"auto"`` to the measuring code
  (layouts.py, measuring.py): chosen by measurement, reverted on evidence.

Sets of architectures that differ at places (another operator at one place,
``optim.fused_segments``) are split first so that every place gives one shape
(:func:`~.fused_fit.fitting_sets`, on meta tensors). What the model read is cached per worker
process: the shapes of the first batch of epoch 0
(the same for every segment, so a resumed segment decides as an uninterrupted one) per data
key, and each architecture's costs per input shape. With the shapes it reads, once per data
key, what the estimate of apart needs of the loader: its own pace per batch (``produce_s``)
and what a job pays per epoch to start its loaders (``start_s``, per batch of the epoch):
timed, so they enter only the choices that time may make (apart or CSE: bit-identical).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import time

import torch
from torch import nn

from ...optim import fusion_key
from ...optim import device_model
from ...optim.device_model import batching_wins, predicted_fused_speedup, step_costs
from ...optim.passes import LayoutPasses, PassManager, get_pass
from ...training import batch_size
from ..storage import checkpoint as ckpt
from .fused_fit import fitting_sets
from .group_candidates import plan_group

__all__ = ["Resolved", "batches_in", "loader_starts", "resolve"]

# data key -> (meta inputs, examples, seconds the loader takes to make a batch on its own,
# a job's loader starts per epoch per batch of the epoch)
_INPUTS: dict[str, tuple[tuple, int, float, float] | None] = {}
_COSTS: dict[tuple, Any] = {}                        # (architecture, shapes) -> StepCosts


class _Stop(Exception):
    """Raised by the recorder at the model's call: nothing after it runs."""


class _Recorder(nn.Module):
    """Stands for the model in one ``training_step``: keeps what the model is called with."""

    def __init__(self):
        super().__init__()
        self.args: tuple | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs:
            self.args = tuple(torch.empty_like(a, device="meta") if isinstance(a, torch.Tensor)
                              else a for a in args)
        raise _Stop


def _inputs(trainer: Any, run: Any, data_key: str) -> tuple[tuple, int] | None:
    """What the models are called with on the first batch of epoch 0 (as meta tensors) and
    that batch's examples; None when it cannot be read (the model is then not consulted:
    nothing fuses or batches under ``"auto"``)."""
    if data_key in _INPUTS:
        return _INPUTS[data_key]
    outer = ckpt.native_rng()
    found = None
    try:
        batches = iter(trainer.train_dataloader(run.hparams, 0))
        batch = next(batches, None)
        produce = []  # the next batches' waits: the loader's own pace (its start paid above)
        for _ in range(2):
            t0 = time.perf_counter()
            if next(batches, None) is None:
                break
            produce.append(time.perf_counter() - t0)
        if batch is not None:
            rec = _Recorder()
            try:
                trainer.training_step(rec, batch, run.hparams)
            except _Stop:
                pass
            if rec.args is not None:
                pace = min(produce, default=0.0)
                found = (rec.args, batch_size(batch), pace,
                         loader_starts(trainer, run, batches_in(trainer, run), pace))
    except Exception:  # noqa: BLE001 (a trainer that cannot be read so: no prediction)
        found = None
    finally:
        ckpt.set_native_rng(outer)
    _INPUTS[data_key] = found
    return found


def batches_in(trainer: Any, run: Any) -> int | None:
    """The batches of epoch 0 when its loader says (``len``), else None."""
    try:
        return len(trainer.train_dataloader(run.hparams, 0)) or None
    except Exception:  # noqa: BLE001 (a loader without a length: the starts are not counted)
        return None


def loader_starts(trainer: Any, run: Any, batches: int | None, pace: float,
                  clock: Callable[[], float] = time.perf_counter) -> float:
    """What a job pays per epoch to start its loaders, per batch of the epoch: the
    validation loader's start and first batch (timed here: the data set is scanned and cached
    by now, so this is what every job pays), and the training loader's start, counted as the
    validation loader's less a batch's making (``pace``). Each model alone pays them; a merged
    job once. 0 when the epoch's length is unknown or the loader cannot be read.

    Example::

        loader_starts(trainer, run, batches=14, pace=0.03)   # (first + first - 0.03) / 14
    """
    if not batches:
        return 0.0
    try:
        t0 = clock()
        next(iter(trainer.val_dataloader(run.hparams)), None)
        first = clock() - t0
    except Exception:  # noqa: BLE001 (not counted: the estimate stays as without it)
        return 0.0
    return (first + max(0.0, first - pace)) / batches


def _costs(trial: str, models: Mapping, runs: Mapping, inputs: tuple) -> Any:
    shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else repr(a) for a in inputs)
    key = (fusion_key(models[trial]), shapes)
    if key not in _COSTS:
        _COSTS[key] = step_costs(runs[trial].model, inputs)
    return _COSTS[key]


class Resolved:
    """The settings a job trains with once the device model has answered.

    Attributes:
        fuse: True (``fusable`` fuse), False, or ``"auto"`` (decided by measurement).
        fusable: the sets that fuse (under True) or may (under ``"auto"``).
        passes: the optional passes' settings (True, or ``"auto"`` for measured ones).
        decided: whether the device model made a decision (its units are not reverted by time).
        predicted: one line per set the model judged, for the plans row.
        produce_s: the loader's time to make a batch on its own (the estimate of apart).
        start_s: a job's loader starts per epoch, per batch (the estimate of apart).
        cse_bound: the most CSE could gain over apart (``device_model.cse_bound``: the
            frozen layers once, one loader); None when the shapes could not be read.
        cse_floor: the least CSE gains over apart (``device_model.cse_floor``: the same
            savings against a grouped step's cost); None as ``cse_bound``.
    """

    def __init__(self, fuse: Any, fusable: list, passes: LayoutPasses, decided: bool,
                 predicted: list[str], produce_s: float = 0.0, start_s: float = 0.0,
                 cse_bound: float | None = None, cse_floor: float | None = None):
        self.fuse, self.fusable, self.passes = fuse, fusable, passes
        self.decided, self.predicted, self.produce_s = decided, predicted, produce_s
        self.start_s, self.cse_bound, self.cse_floor = start_s, cse_bound, cse_floor


def resolve(fuse: Any, fusable: list[tuple[str, ...]], passes: LayoutPasses, ids: list[str],
            models: Mapping, runs: Mapping, trainer: Any, data_key: str) -> Resolved:
    """Resolve ``fuse`` (the job's setting) and ``passes`` for the candidate group ``ids``
    (``fusable``: its sets that may fuse), see the module docstring."""
    settings = dict(passes.settings)
    device = runs[ids[0]].device
    found = _inputs(trainer, runs[ids[0]], data_key)  # once per data key and process
    fusable = fitting_sets(fusable, models, runs, None if found is None else found[0])
    predicted: list[str] = []
    chosen: list[tuple[str, ...]] = []
    if fuse == "auto":
        for members in fusable:
            if found is None:
                predicted.append(f"{len(members)} models: not fused (no batch to predict from)")
                continue
            try:
                costs = [_costs(t, models, runs, found[0]) for t in members]
                speedup = predicted_fused_speedup(costs, device)
            except Exception as err:  # noqa: BLE001 (a model the meta forward cannot run)
                predicted.append(f"{len(members)} models: not fused ({type(err).__name__})")
                continue
            margin = device_model.FUSE_MARGIN
            take = speedup >= margin
            predicted.append(f"{len(members)} models: predicted {speedup:.2f}x fused, "
                             + ("fused" if take else f"under {margin}x: not fused"))
            if take:
                chosen.append(members)
    for name, value in list(settings.items()):
        if value == "measure":
            settings[name] = "auto"  # the measuring code's word for it
        elif value == "auto":
            settings[name] = _pass_wins(name, found, ids, models, runs, data_key, settings, device)
    bound = floor = None
    if fuse == "auto" and found is not None:  # the default's: may spare the measurement
        try:
            costs = [_costs(t, models, runs, found[0]) for t in ids]
            bound = device_model.cse_bound(costs, found[2] + found[3], device)
            floor = device_model.cse_floor(costs, found[2] + found[3], device)
        except Exception:  # noqa: BLE001 (a model no forward could count: measured)
            bound = floor = None
    decided = fuse == "auto"
    if fuse == "measure":
        out_fuse = "auto"
    elif fuse == "auto":
        out_fuse = bool(chosen)
        fusable = chosen
    else:
        out_fuse = fuse
    return Resolved(out_fuse, fusable if out_fuse else [],
                    LayoutPasses({k: v for k, v in settings.items() if v}),
                    decided or any(v == "auto" for v in passes.settings.values()), predicted,
                    found[2] if found is not None else 0.0, found[3] if found is not None else 0.0,
                    bound, floor)


def _pass_wins(name: str, found: tuple | None, ids: list[str], models: Mapping, runs: Mapping,
               data_key: str, settings: Mapping, device: Any) -> bool:
    """Whether pass ``name`` set ``"auto"`` runs: its plan changes something worth it (the
    pass's own test) and the batch is small enough per model for the device."""
    if found is None:
        return False
    try:  # the frozen layers' work per call decides (device_model.batching_wins)
        if not batching_wins([_costs(t, models, runs, found[0]) for t in ids], device):
            return False
    except Exception:  # noqa: BLE001 (a model the meta forward cannot run: not batched)
        return False
    forced = [n for n, v in settings.items() if v is True]
    base = plan_group({t: models[t] for t in ids}, data_key, {t: runs[t].hparams for t in ids},
                      passes=LayoutPasses({n: True for n in forced}).forced)
    result = PassManager([name]).run(base)
    test = get_pass(name).worth_measuring
    return bool(result.modified and (test is None or test(result, device)))
