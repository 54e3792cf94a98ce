"""Packing models onto devices (paper §5.2 "Executable Graph Construction", Fig. 12).

A pure decision over plain numbers: given each model's profile (its time per training
iteration alone and its peak memory alone) and the devices (a name and the memory each lends
to models), :func:`pack` says which models train together on which device. The engine turns
each pack into one job (its models merged by the plan's passes) on its device; on a CPU-only
machine a device is a worker slot (docs/optimization.md, "Packing onto devices").

The rule, in the paper's words made precise:

1. **Sort by iteration time** (slowest first), so that a pack holds models of similar speed:
   a merged job's step runs every member, and a job ends with its slowest member, so a fast
   model packed with slow ones waits (Fig. 12's unbalanced packs).
2. **Cut the sorted list into contiguous packs**, each as large as fits: at most
   ``max_models`` models, their summed memory within the device budget, and (optionally) the
   slowest member at most ``spread`` times the fastest. Among such cuts, the one whose
   largest pack time (the sum of its members' iteration times: a merged job on one device
   runs its models' parts one after another) is smallest while using no more packs than there
   are devices, found by bisection on that time: a slow pack gets fewer models, a fast one
   more, so every device's packs take about as long.
3. **Assign packs to devices**, longest first, each to the device that ends earliest and has
   the memory (LPT scheduling); a device may get several packs, run one after the other.

Memory of a pack is the sum of its members' (merging may share layers and so use less: the
sum is the safe side). A model larger than every device cannot be packed: :class:`PackingError`
names it, unless ``oversize="alone"`` puts it alone on the largest device (where it may still
run out of memory, and the engine's failure handling takes over).

Example::

    >>> profiles = [ModelProfile("a", 0.10, 3 << 30), ModelProfile("b", 0.09, 3 << 30),
    ...             ModelProfile("c", 0.02, 1 << 30), ModelProfile("d", 0.02, 1 << 30)]
    >>> placement = pack(profiles, [Device("cuda:0", 8 << 30), Device("cuda:1", 8 << 30)])
    >>> placement.packs
    {'cuda:0': [('b', 'c', 'd')], 'cuda:1': [('a',)]}
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["ModelProfile", "Device", "PackingConfig", "Placement", "PackingError", "pack"]


class PackingError(ValueError):
    """The models cannot be placed as asked (bad profiles, no device large enough)."""


@dataclass(frozen=True)
class ModelProfile:
    """What one model costs trained alone.

    Args:
        trial_id: the trial (unique among the profiles packed together).
        iter_s: seconds per training iteration (forward, backward, optimizer step), > 0.
        memory: peak bytes while training: ``torch.cuda.max_memory_allocated`` on a GPU; on a
            CPU the estimate of :func:`retiarii.optim.profile.profile_model`.
    """

    trial_id: str
    iter_s: float
    memory: int


@dataclass(frozen=True)
class Device:
    """Where packs run: a GPU (``"cuda:0"``) or, on a CPU-only machine, a worker slot.

    Args:
        name: unique among the devices.
        memory: bytes this device lends to the models of its packs (> 0; ``math.inf`` for
            no limit).
    """

    name: str
    memory: float


@dataclass(frozen=True)
class PackingConfig:
    """How :func:`pack` cuts packs; every field has the default the engine uses."""

    max_models: int = 50  # models per pack: the paper plans in batches of 50
    spread: float | None = None  # largest slowest/fastest iteration time within a pack
    #                              (None: no limit; sorting already keeps packs similar)
    oversize: str = "error"  # a model above every device's memory: "error" or "alone"


@dataclass
class Placement:
    """The outcome of :func:`pack`: device name -> its packs (tuples of trial ids), in the
    order they run; ``alone`` lists oversized models placed alone (``oversize="alone"``)."""

    packs: dict[str, list[tuple[str, ...]]]
    iter_s: dict[str, float] = field(default_factory=dict)  # trial -> its profiled time
    alone: tuple[str, ...] = ()

    def pack_time(self, pack: tuple[str, ...]) -> float:
        """Seconds per iteration of a merged pack: its members' times summed."""
        return sum(self.iter_s[t] for t in pack)

    def device_time(self, device: str) -> float:
        """Seconds per iteration of every pack of ``device``, run one after the other."""
        return sum(self.pack_time(p) for p in self.packs[device])

    def device_of(self, trial_id: str) -> str:
        for device, packs in self.packs.items():
            if any(trial_id in p for p in packs):
                return device
        raise KeyError(f"trial {trial_id!r} is not in this placement")

    def record(self) -> dict:
        """What the plans table keeps: the packs per device with their times, and the
        balance (the slowest device's time over the mean)."""
        times = {d: self.device_time(d) for d in self.packs}
        busy = [t for t in times.values() if t > 0]
        return {"devices": {d: {"packs": [list(p) for p in ps], "iter_s": round(times[d], 6)}
                            for d, ps in self.packs.items()},
                "balance": round(max(busy) / (sum(busy) / len(busy)), 3) if busy else None,
                "alone": list(self.alone)}


def _check(profiles: list[ModelProfile], devices: list[Device], config: PackingConfig) -> None:
    if not devices:
        raise PackingError("no devices to pack onto: give at least one Device")
    names = [d.name for d in devices]
    if len(set(names)) != len(names):
        raise PackingError(f"device names must be unique, got {names}")
    for d in devices:
        if not d.memory > 0:
            raise PackingError(f"device {d.name!r} lends memory={d.memory!r}: give bytes > 0 "
                               f"(math.inf for no limit)")
    ids = [p.trial_id for p in profiles]
    if len(set(ids)) != len(ids):
        raise PackingError(f"each trial must be profiled once, got {sorted(ids)}")
    for p in profiles:
        if not (isinstance(p.iter_s, (int, float)) and math.isfinite(p.iter_s) and p.iter_s > 0):
            raise PackingError(f"trial {p.trial_id!r}: iter_s={p.iter_s!r}; profile it to get "
                               f"a time per iteration > 0")
        if not p.memory >= 0:
            raise PackingError(f"trial {p.trial_id!r}: memory={p.memory!r}; give bytes >= 0")
    if not isinstance(config.max_models, int) or config.max_models < 1:
        raise PackingError(f"max_models={config.max_models!r}: give a number of models >= 1")
    if config.spread is not None and not config.spread >= 1:
        raise PackingError(f"spread={config.spread!r}: give a ratio >= 1, or None")
    if config.oversize not in ("error", "alone"):
        raise PackingError(f"oversize={config.oversize!r}: give 'error' or 'alone'")


def _cut(order: list[ModelProfile], limit: float, budget: float, config: PackingConfig
         ) -> list[list[ModelProfile]]:
    """Contiguous packs of ``order`` (slowest first), each closed as late as its time
    (``limit``), memory (``budget``), size and spread allow: the fewest packs for that time."""
    packs: list[list[ModelProfile]] = []
    current: list[ModelProfile] = []
    time = memory = 0.0
    for p in order:
        fits = (current and len(current) < config.max_models and time + p.iter_s <= limit
                and memory + p.memory <= budget
                and (config.spread is None or current[0].iter_s <= config.spread * p.iter_s))
        if current and not fits:
            packs.append(current)
            current, time, memory = [], 0.0, 0.0
        current.append(p)
        time, memory = time + p.iter_s, memory + p.memory
    if current:
        packs.append(current)
    return packs


def _balanced_cut(order: list[ModelProfile], slots: int, budget: float,
                  config: PackingConfig) -> list[list[ModelProfile]]:
    """The cut whose largest pack time is smallest while using at most ``slots`` packs (or
    the fewest packs possible, when memory, size or spread need more)."""
    loosest = _cut(order, math.inf, budget, config)
    if len(loosest) >= slots:
        return loosest  # memory, size or spread already need a pack per device or more
    lo, hi = max(p.iter_s for p in order), sum(p.iter_s for p in order)
    for _ in range(60):  # bisection on the largest pack's time: 2^-60 of the range
        mid = (lo + hi) / 2
        if len(_cut(order, mid, budget, config)) <= slots:
            hi = mid
        else:
            lo = mid
    return _cut(order, hi, budget, config)


def pack(profiles: list[ModelProfile], devices: list[Device],
         config: PackingConfig = PackingConfig()) -> Placement:
    """Place ``profiles`` on ``devices`` (see the module docstring for the rule).

    Example::

        placement = pack([ModelProfile("t1", 0.05, 2 << 30), ...], [Device("cuda:0", 70 << 30)])
        placement.packs["cuda:0"]        # [("t1", ...), ...]: one merged job per pack

    Args:
        profiles: one per model, ids unique.
        devices: where packs may run, names unique.
        config: the pack size, spread and oversize policy.

    Raises:
        PackingError: bad profiles or devices, or a model larger than every device (with
            ``oversize="error"``).
    """
    profiles, devices = list(profiles), list(devices)
    _check(profiles, devices, config)
    out = Placement({d.name: [] for d in devices}, {p.trial_id: p.iter_s for p in profiles})
    if not profiles:
        return out
    largest = max(devices, key=lambda d: d.memory)
    # every pack formed below fits every device; a model above the smallest device's memory
    # is packed alone, on a device that holds it
    budget = min(d.memory for d in devices)
    big = [p for p in profiles if p.memory > budget]
    oversized = [p for p in big if p.memory > largest.memory]
    if oversized and config.oversize == "error":
        worst = max(oversized, key=lambda p: p.memory)
        raise PackingError(
            f"trial {worst.trial_id!r} needs {worst.memory / 2**20:.1f} MiB to train, more than "
            f"any device lends (the largest, {largest.name!r}, {largest.memory / 2**20:.1f} MiB): "
            f"give it a larger device or a smaller batch, or pass oversize='alone' to place it "
            f"alone on {largest.name!r} anyway")
    order = sorted((p for p in profiles if p.memory <= budget),
                   key=lambda p: (-p.iter_s, p.trial_id))
    packs = _balanced_cut(order, len(devices), budget, config) if order else []
    packs += [[p] for p in sorted(big, key=lambda p: (-p.iter_s, p.trial_id))]
    ends = {d.name: 0.0 for d in devices}
    for members in sorted(packs, key=lambda ms: -sum(p.iter_s for p in ms)):  # LPT
        need = sum(p.memory for p in members)
        fit = [d for d in devices if d.memory >= need] or [largest]
        device = min(fit, key=lambda d: (ends[d.name], devices.index(d)))
        out.packs[device.name].append(tuple(p.trial_id for p in members))
        ends[device.name] += sum(p.iter_s for p in members)
    out.alone = tuple(sorted(p.trial_id for p in oversized))
    return out
