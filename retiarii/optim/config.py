"""One object for the cross-model optimization options of an experiment: :class:`OptimizeConfig`.

``Experiment(optimize=OptimizeConfig(...))`` and the older keyword arguments
(``Experiment(optimize="auto", fuse=..., batching=..., packing=...)``) build the same object;
the engine reads only this one. Each field's comment says why its default is what it is.

Example::

    import retiarii as rt
    opt = rt.OptimizeConfig(mode=True, passes={"batching": True}, batch_models=16)
    rt.Experiment(space, rt.strategies.Random(), trainer, optimize=opt)
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .passes import optional_passes, parse_settings

__all__ = ["OptimizeConfig"]

_MODES = ("auto", True, False, "pack")


def _setting(name: str, value: Any) -> None:
    if value not in ("auto", "measure", True, False, None) or isinstance(value, (int, float)) \
            and not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: give 'auto', 'measure', True or False (or leave "
                         f"it out: 'auto' under optimize='auto', else False)")


@dataclass(frozen=True)
class OptimizeConfig:
    """How the models of a multi-trial search train together (docs/optimization.md).

    Args:
        mode: ``"auto"``: up to ``batch_models`` trials that read the same batches (equal
            ``Trainer.data_key``) train as one job: one data pipeline, their common frozen
            layers once; each group is measured and reverted when slower than its models
            apart. ``True``: the same, never reverted for speed (nothing measured).
            ``False``: every model alone (the baseline). ``"pack"``: jobs packed as with True,
            each model of a job alone in it (the paper's packing without merging).
        batch_models: the most trials one job trains.
        fuse: whether the trials of a grouped job with one architecture (the same choices,
            other hyper-parameters or seeds) train as one fused model (docs/optimization.md,
            "Fused training of same-shape models"): ``"auto"`` when the device model
            (:mod:`retiarii.optim.device_model`: the models' shapes, never a measurement)
            predicts it faster, so every run of a seeded search fuses the same models;
            ``"measure"`` when measured faster on the first batches and reverted when a
            segment measures it slower (faster where the device model is wrong, but results
            then depend on the machine's load); True whenever possible, False never
            (results then equal training alone bit for bit on CPU; fused ones within float
            rounding); None: the mode's default (``"auto"`` under ``mode="auto"``, else
            False).
        passes: the optional plan passes (:mod:`retiarii.optim.passes`), name -> True, False
            ``"auto"`` or ``"measure"``; a pass left out takes its registered default under
            ``mode="auto"`` (``batching``: ``"auto"``: decided by the device model from the
            plan and the batch size; ``"measure"``: measured against CSE alone) and is off
            otherwise.
        packing: how a batch of trials is split over the free workers (docs/optimization.md,
            "Packing onto devices"): by profiles (True: models of similar iteration time
            together, every worker about equally busy, none over its memory; profiles are
            estimated from the IR, then scaled by what workers measure), as evenly as they go
            (False), or ``"auto"``: by profiles on GPUs and on two CPU workers or more
            (one CPU worker: in proposal order).
        dedicated: modules that get a device of their own in a grouped job (``fnmatch``
            patterns of module names, or class names): a shared frozen part holding one is
            computed there one batch ahead of the models (docs/optimization.md, "Dedicated
            devices"). Results are unchanged.
        dedicated_device: ``"process"``, ``"thread"`` or ``"cuda:N"``; None: per worker.
        memory_budget: what one job's models may use of a worker slot's memory (the GPU's, or
            on a CPU the machine's shared by the slots): a fraction in (0, 1], or bytes. A
            job whose models' estimated memory (the sum of each alone, from the IR: merging
            only shares) is over it is split into jobs that fit (a model over it alone
            trains alone).
    """

    # "auto": the search decides per group, by measurement, and reverts what loses; the
    # engine's reason to exist, so the default.
    mode: Any = "auto"
    # 8 keeps a job's memory modest (the paper plans in batches of 50 on larger GPUs).
    batch_models: int = 8
    # None follows the mode: the device model decides under "auto", off under True.
    fuse: Any = None
    # Optional pass -> setting; what is left out follows the mode (see the field's doc).
    passes: Mapping[str, Any] = field(default_factory=dict)
    # "auto": profiles matter where memory decides what fits (GPUs) and where two CPU workers
    # or more should be equally busy (an even split by count idled one of two for half of a
    # search whose models differ in size: benchmarks/held_out.py, "depth").
    packing: Any = "auto"
    # Nothing dedicated unless asked: a device of its own pays only for a large shared part.
    dedicated: tuple[str, ...] = ()
    dedicated_device: str | None = None
    # 0.8: room for the data pipeline and the allocator's slack; the total memory of a slot,
    # not what is free now, so that which models share a job never depends on the machine's
    # load (fused values depend on their companions: docs/optimization.md)
    memory_budget: float = 0.8

    def __post_init__(self):
        if self.mode not in _MODES or isinstance(self.mode, int) and not isinstance(
                self.mode, bool):
            raise ValueError(f"optimize={self.mode!r}: give 'auto', True, False or 'pack'")
        if self.packing not in ("auto", True, False):
            raise ValueError(f"packing={self.packing!r}: give 'auto', True or False")
        if not isinstance(self.batch_models, int) or isinstance(self.batch_models, bool) \
                or self.batch_models < 1:
            raise ValueError(f"batch_models={self.batch_models!r}: give a number of trials >= 1")
        _setting("fuse", self.fuse)
        if self.dedicated is None or isinstance(self.dedicated, str) or not all(
                isinstance(p, str) and p for p in self.dedicated):
            raise ValueError(f"dedicated={self.dedicated!r}: give a list of module names or "
                             f"class names, e.g. ['encoder']")
        object.__setattr__(self, "dedicated", tuple(self.dedicated))
        if self.dedicated_device not in (None, "process", "thread") and not str(
                self.dedicated_device).startswith("cuda"):
            raise ValueError(f"dedicated_device={self.dedicated_device!r}: give 'process', "
                             f"'thread' or 'cuda:N' (None: chosen per worker)")
        if isinstance(self.memory_budget, bool) or not isinstance(
                self.memory_budget, (int, float)) or not self.memory_budget > 0:
            raise ValueError(f"memory_budget={self.memory_budget!r}: give a fraction of each "
                             f"slot's memory in (0, 1] (e.g. 0.8) or a number of bytes")
        for name, value in dict(self.passes).items():
            _setting(name, value)
        object.__setattr__(self, "passes", parse_settings(dict(self.passes)))

    @property
    def effective_fuse(self) -> Any:
        """``fuse`` with the mode's default filled in."""
        if self.fuse is not None:
            return self.fuse
        return "auto" if self.mode == "auto" else False

    @property
    def effective_passes(self) -> dict[str, Any]:
        """Every optional pass's setting, the mode's default filled in (True or ``"auto"``
        for those that run; False for those that do not)."""
        return {p.name: self.passes.get(p.name, p.default if self.mode == "auto" else False)
                for p in optional_passes()}

    def to_json(self) -> dict:
        """The options as JSON (kept in an experiment's origin; :meth:`from_json` reads it)."""
        return {"mode": self.mode, "batch_models": self.batch_models, "fuse": self.fuse,
                "passes": dict(self.passes), "packing": self.packing,
                "dedicated": list(self.dedicated), "dedicated_device": self.dedicated_device,
                "memory_budget": self.memory_budget}

    @classmethod
    def from_json(cls, data: Mapping) -> OptimizeConfig:
        return cls(**{**data, "dedicated": tuple(data.get("dedicated") or ())})
