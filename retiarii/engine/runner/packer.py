"""How the :class:`~.trials.TrialRunner` splits a batch of trials over its free slots
(packing models onto devices: docs/optimization.md, "Packing onto devices").

:class:`Packer` is a collaborator the runner holds, with one entry point, :meth:`Packer.packs`:
the trials that may train together (one group key), the number of free slots and the step
times alone measured so far in, the jobs to launch out. Without packing (``packing=False``), as before: the
trials spread over the slots as evenly as they go. With packing, each trial's profile (its
iteration time and memory; :mod:`retiarii.optim.profile`) goes to
:func:`retiarii.optim.packing.pack` over one :class:`~retiarii.optim.packing.Device` per free
slot, lending the executor's ``slot_memory()``: similar models together, every slot about
equally busy, no slot over its memory.

Profiles: the experiment estimates each trial's from its IR when it proposes it
(``config["profile"] = {"units": ..., "memory": ...}``: no model is built in the driver);
a trial whose grouped job measured its separate step time (``alone_s``) uses that, and the
estimates of the others are scaled to seconds by the median measured/estimated ratio, so
measured and estimated trials compare. A trial without a profile makes the batch fall back
to the even split.

The decision of each pack is kept until the runner launches it (:meth:`Packer.take_note`),
for the plans table.
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from ...optim.packing import Device, ModelProfile, PackingConfig, pack
from .trial import Trial

__all__ = ["Packer", "even_split"]


def even_split(batch: list[Trial], slots: int) -> list[list[Trial]]:
    """``batch`` over ``slots`` jobs as evenly as it goes, in order (the first
    ``len % jobs`` jobs one trial larger)."""
    jobs = max(1, min(slots, len(batch)))
    size, extra = divmod(len(batch), jobs)
    out, start = [], 0
    for i in range(jobs):
        end = start + size + (i < extra)
        out.append(batch[start:end])
        start = end
    return out


class Packer:
    """Splits batches of trials over free slots (see the module docstring).

    Args:
        packing: by profiles (True), or as evenly as they go (False).
        slot_memory: the bytes each slot lends to models.
        batch_models: the most trials one pack holds.
        memory_budget: what one pack may use of ``slot_memory``: a fraction in (0, 1], or
            bytes (``OptimizeConfig.memory_budget``).
    """

    def __init__(self, packing: bool = False, slot_memory: float = float("inf"),
                 batch_models: int = 1, memory_budget: float = 1.0):
        self.packing, self.slot_memory, self.batch_models = packing, slot_memory, batch_models
        self.budget = slot_memory * memory_budget if memory_budget <= 1 else float(memory_budget)
        if self.packing:  # profiles pack within the budget
            self.slot_memory = min(slot_memory, self.budget)
        self.placements: list[dict] = []  # every placement made, in order
        self._notes: dict[str, dict] = {}  # first trial of a pack -> its decision, until launched
        self._units: dict[str, float] = {}  # trial -> its estimate, in units
        self._scale: float | None = None  # seconds per unit, from the trials measured so far
        self._alone_s: Mapping[str, float] = {}

    def packs(self, batch: list[Trial], slots: int,
              alone_s: Mapping[str, float] | None = None) -> list[list[Trial]]:
        """The jobs that train ``batch`` (one group key) on ``slots`` free slots;
        ``alone_s``: trial -> its step time alone, measured by grouped jobs so far."""
        self._alone_s = alone_s or {}
        if not self.packing or len(batch) < 2:
            return self._within_budget(even_split(batch, slots))
        profiles = self._profiles(batch)
        if profiles is None:
            return even_split(batch, slots)
        devices = [Device(f"slot-{i}", self.slot_memory) for i in range(max(1, slots))]
        placement = pack(profiles, devices,
                         PackingConfig(max_models=self.batch_models, oversize="alone"))
        record = placement.record()
        self.placements.append(record)
        by_id = {t.trial_id: t for t in batch}
        out = []
        for device, packs in placement.packs.items():
            for members in packs:
                out.append([by_id[t] for t in members])
                self._notes[members[0]] = {
                    "device": device, "models": len(members),
                    "predicted_iter_s": round(placement.pack_time(members), 6),
                    "balance": record["balance"],
                    "source": "measured" if self._scale is not None else "estimated (units)"}
        return out

    def _within_budget(self, packs: list[list[Trial]]) -> list[list[Trial]]:
        """``packs`` with each one whose models' estimated memory (the sum of each alone:
        merging only shares) is over the budget cut into consecutive packs that fit; a
        model over it alone is a pack of its own. A trial without an estimate counts 0."""
        if self.budget == float("inf"):
            return packs
        out: list[list[Trial]] = []
        for job in packs:
            cut: list[list[Trial]] = [[]]
            used = 0.0
            for trial in job:
                need = float((trial.config.get("profile") or {}).get("memory") or 0)
                if cut[-1] and used + need > self.budget:
                    cut.append([])
                    used = 0.0
                cut[-1].append(trial)
                used += need
            if len(cut) > 1:  # said in the plans rows of these jobs
                for part in cut:
                    self._notes[part[0].trial_id] = {
                        "split": "memory", "budget_bytes": self.budget, "models": len(part),
                        "of": len(job)}
            out.extend(p for p in cut if p)
        return out

    def take_note(self, first: str) -> dict | None:
        """The packing decision of the pack led by trial ``first``, once it is launched (the
        runner keeps it on its job, for the plans table); None when it was not packed."""
        return self._notes.pop(first, None)

    def _profiles(self, batch: list[Trial]) -> list[ModelProfile] | None:
        """Every trial's profile in seconds (measured, or estimated and scaled by what was
        measured), or in estimate units for all when nothing is measured yet; None when a
        trial has no estimate."""
        memory: dict[str, float] = {}
        for trial in batch:
            estimate: Any = trial.config.get("profile")
            if not isinstance(estimate, dict) or not estimate.get("units"):
                return None
            self._units[trial.trial_id] = float(estimate["units"])
            memory[trial.trial_id] = float(estimate.get("memory") or 0)
        ratios = [s / self._units[t] for t, s in self._alone_s.items()
                  if t in self._units and s and s > 0]
        self._scale = statistics.median(ratios) if ratios else None
        out = []
        for trial in batch:
            t = trial.trial_id
            if self._scale is None:
                iter_s = self._units[t]
            else:
                iter_s = self._alone_s.get(t) or self._units[t] * self._scale
            out.append(ModelProfile(t, iter_s, int(memory[t])))
        return out
