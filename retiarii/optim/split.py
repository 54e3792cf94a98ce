"""Splitting a super-graph that one device cannot hold over several (paper §5.2, "Mixed
Parallelism": "Retiarii spreads the instantiated models into multiple super-graphs (each on a
GPU) to be trained together", the shared weights kept equal by averaging their gradients).

With mixed parallelism (:mod:`retiarii.optim.mixed_parallel`) each of K ranks trains its own
sampled model per step, and by default every rank holds the whole super-graph. When the pool's
weights and their optimizer state do not fit one device, each rank should hold only the
operators of the models it trains. That is a packing decision over the models the strategy
instantiates (SPOS: K new models per step, drawn ahead for a segment), made here as a pure
function of plain numbers, as :mod:`retiarii.optim.packing` decides for whole models:

1. **Replicate when it fits.** If the union of every operator the segment's models use fits
   ``memory``, every rank holds it all and trains the models in the strategy's own order (rank r
   the r-th of each step): the plain mixed parallelism, nothing moves.
2. **Else split, window by window.** The steps are cut into windows; within a window each rank
   trains as many models as the others (the ranks step together), and the window's models are
   assigned greedily, largest first, each to a rank where it still fits and, among those,
   where it adds the fewest bytes (operators it does not hold yet), ties to the rank that held
   more of them in the previous window (less to move), then the lightest: models that share
   operators land together, so each rank's super-graph is the union of similar models. A
   window is as long as fits: the previous window's length doubled first, then halved until
   every rank's union fits ``memory``.
3. Between windows the operators move (the runtime, :mod:`retiarii.strategies.one_shot.split_training`):
   a rank gets what it now needs from the rank that held it (weights and optimizer state), and
   what no rank needs any more is parked in host memory.

A model whose own operators exceed ``memory`` cannot train on any device:
:class:`~retiarii.optim.packing.PackingError` names it with the bytes.

Bytes are what a device holds for the *weights*: a trained weight with its gradient and the
optimizer's state, frozen weights and buffers once
(:meth:`~retiarii.optim.supergraph.SuperGraph.training_bytes`). Activations of the one model a
rank runs at a time are the same with or without a split: leave room for them in ``memory``.

Example::

    >>> ops = [{"stem": 4, "a": 10}, {"stem": 4, "b": 10}, {"stem": 4, "a": 10},
    ...        {"stem": 4, "b": 10}]          # two steps of two ranks
    >>> split_paths(ops, world=2, memory=20).windows[0].paths  # a on one rank, b on the other
    ((0, 2), (1, 3))
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from .packing import PackingError

__all__ = ["SuperGraphSplit", "Window", "parse_bytes", "split_paths"]


@dataclass(frozen=True)
class Window:
    """Consecutive steps of a split segment: which models each rank trains and holds.

    ``paths[r]`` are indices into the schedule given to :func:`split_paths` (each rank as many,
    in schedule order: the order rank r trains them), ``held[r]`` the weight keys rank r holds
    during the window, ``bytes[r]`` their bytes."""

    start: int  # the window's first step
    steps: int
    paths: tuple[tuple[int, ...], ...]
    held: tuple[frozenset, ...]
    bytes: tuple[int, ...]


@dataclass(frozen=True)
class SuperGraphSplit:
    """The outcome of :func:`split_paths`."""

    world: int
    memory: float
    replicated: bool  # every rank holds every operator: plain mixed parallelism
    windows: tuple[Window, ...]

    def record(self) -> dict:
        """A summary for the run's records: mode, windows and the largest rank's bytes."""
        peak = max((b for w in self.windows for b in w.bytes), default=0)
        return {"mode": "replicated" if self.replicated else "split",
                "windows": len(self.windows), "peak_bytes": peak,
                "memory": None if math.isinf(self.memory) else self.memory}


_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(value: float | int | str) -> float:
    """Bytes from a number or a size such as ``"512MiB"``, ``"20GB"``, ``"1.5 GiB"``.

    Example:
        >>> parse_bytes("2KiB"), parse_bytes(1e9), parse_bytes("1.5 kB")
        (2048.0, 1000000000.0, 1500.0)

    Raises:
        ValueError: not a positive size (naming the value and the accepted units).
    """
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(number):]
        try:
            amount = float(number) * _UNITS[unit]
        except (KeyError, ValueError):
            amount = -1.0
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        amount = float(value)
    else:
        amount = -1.0
    if not amount > 0 or math.isnan(amount):
        raise ValueError(f"device_memory={value!r}: give positive bytes, as a number or a size "
                         f"with a unit ({', '.join(u for u in _UNITS if u)}), e.g. '20GiB'")
    return amount


def _union_bytes(paths: Sequence[Mapping[str, int]]) -> tuple[frozenset, int]:
    sizes: dict[str, int] = {}
    for ops in paths:
        sizes.update(ops)
    return frozenset(sizes), sum(sizes.values())


def _assign(paths: Sequence[Mapping[str, int]], first: int, world: int, steps: int,
            previous: Sequence[frozenset], memory: float
            ) -> tuple[list[list[int]], list[set], list[int]]:
    """Greedy assignment of the window's paths (indices first .. first + world * steps - 1):
    each to a rank where it still fits if any, adding the fewest bytes."""
    members: list[list[int]] = [[] for _ in range(world)]
    held: list[set] = [set() for _ in range(world)]
    size = [0] * world
    order = sorted(range(first, first + world * steps), key=lambda i: -sum(paths[i].values()))
    for i in order:
        ops = paths[i]
        best, best_rank = None, 0
        for r in range(world):
            if len(members[r]) >= steps:
                continue
            added = sum(b for k, b in ops.items() if k not in held[r])
            kept = sum(b for k, b in ops.items() if k in previous[r])
            rank_key = (size[r] + added > memory, added, -kept, size[r], r)
            if best is None or rank_key < best:
                best, best_rank = rank_key, r
        members[best_rank].append(i)
        for k, b in ops.items():
            if k not in held[best_rank]:
                held[best_rank].add(k)
                size[best_rank] += b
    return [sorted(m) for m in members], held, size


def split_paths(paths: Sequence[Mapping[str, int]], world: int,
                memory: float) -> SuperGraphSplit:
    """Decide which rank trains and holds what; see the module docstring.

    Args:
        paths: the segment's schedule: ``paths[i * world + r]`` maps each weight key of the
            model that rank r would train at step i (the strategy's order) to its bytes.
        world: the number of ranks (>= 1).
        memory: the bytes each device lends to the super-graph's weights (``math.inf``: no
            limit).

    Raises:
        PackingError: a bad argument, or a model whose operators alone exceed ``memory``.
    """
    if not isinstance(world, int) or world < 1:
        raise PackingError(f"split_paths needs world >= 1 ranks, got {world!r}")
    if not memory > 0:
        raise PackingError(f"memory must be positive bytes (or math.inf), got {memory!r}")
    if len(paths) % world:
        raise PackingError(f"{len(paths)} paths for {world} ranks: give world paths per step")
    total_steps = len(paths) // world
    keys, total = _union_bytes(paths)
    if total <= memory:
        natural = tuple(tuple(range(r, len(paths), world)) for r in range(world))
        return SuperGraphSplit(world, memory, True, (Window(
            0, total_steps, natural, (keys,) * world, (total,) * world),) if paths else ())
    for i, ops in enumerate(paths):
        own = sum(ops.values())
        if own > memory:
            raise PackingError(
                f"the model at step {i // world} of rank {i % world} needs {own} bytes for its "
                f"weights and optimizer state, more than the {memory:.0f} bytes a device lends "
                "(device_memory): no split can train it; give more memory, or use a smaller "
                "space or an optimizer with less state")
    windows: list[Window] = []
    previous: list[frozenset] = [frozenset()] * world
    start, length = 0, total_steps
    while start < total_steps:
        length = min(length, total_steps - start)
        while True:
            members, held, size = _assign(paths, start * world, world, length, previous,
                                           memory)
            if max(size) <= memory or length == 1:
                break
            length = max(1, length // 2)
        # (length 1 always fits: each rank holds one model, checked above)
        window = Window(start, length, tuple(tuple(m) for m in members),
                        tuple(frozenset(h) for h in held), tuple(size))
        windows.append(window)
        previous = list(window.held)
        start += length
        length *= 2
    return SuperGraphSplit(world, memory, False, tuple(windows))
