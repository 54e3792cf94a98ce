"""Batched regions: chains of batched operators over the same models run as one call.

The batching pass (batching.py) decides which frozen or weightless per-example operators run
once on their models' inputs concatenated along dim 0. Run one by one, each batched operator
pays a concatenation of its inputs, a split of its output back per model (and, in backward, a
concatenation of the gradients), and the bookkeeping of one batched call: behind an adapter
in a frozen MobileNetV2 every convolution, FrozenBatchNorm, ReLU6 and residual add is one.
A *region* is a connected run of batched operators over the same models, in the same order,
whose inputs from outside the region are ready before its first operator: it runs as one
call on the concatenated inputs, and only the values read outside it are split back::

    per operator:  cat -> conv* -> split -> cat -> bn* -> split -> cat -> relu -> split
    one region:    cat -> conv* -> bn* -> relu -> split

Because every operator in a region acts per example (batching.py's rule), a region called on
one model's inputs computes exactly that model's values: this is what a group runs for models
whose inputs cannot be concatenated (other shapes), as it did per operator.

A pure function of the plan and the order build.py gave the batched operators (their
*levels*) and the models' own nodes (their *stages*): no I/O, no modules.

Example::

    regions = batch_regions(plan, levels, stage, shared_at)
    [r.members for r in regions]   # [[0, 1, 2, 3], [4, 5]]: plan.batches indices
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .plan import LogicalPlan

__all__ = ["Region", "batch_regions"]


@dataclass
class Region:
    """Batched operators (indices into ``plan.batches``) that run as one call.

    Attributes:
        members: in plan (topological) order; the first's level is the region's.
        trials: the models, in the order of every member's pairs.
        level: when it runs (before the models' cells of this stage).
        inputs: per input position, each trial's key (values from outside the region).
        wiring: per member, per input port: ``("in", position)`` or ``("op", member)``
            (the output of an earlier member, same models, same order).
        exports: members whose outputs are read outside the region (split back per model).
    """

    members: list[int]
    trials: tuple[str, ...]
    level: int
    inputs: list[tuple[str, ...]] = field(default_factory=list)
    wiring: list[list[tuple[str, int]]] = field(default_factory=list)
    exports: list[int] = field(default_factory=list)


def batch_regions(plan: LogicalPlan, levels: list[int], stage: Mapping[tuple[str, str], int],
                  shared_at: Callable[[str, str], bool],
                  mutates: list[bool] | None = None) -> list[Region]:
    """Group ``plan.batches`` into regions (module docstring), greedily in plan order.

    A batched operator joins the region of an operator whose output it reads when it runs
    over the same models in the same order, every input port reads either one member's output
    in every model or a value from outside in every model, those outside values are ready
    before the region runs (shared; a model's own value of an earlier stage; a batched value of
    an earlier region) and nothing writes them in place, and neither it nor the region writes
    in place. Otherwise it starts a region of its own.

    Args:
        plan: the group's plan after the passes.
        levels: per ``plan.batches`` index, the level build.py gave it.
        stage: (trial, key) -> the stage of a model's own node.
        shared_at: whether a (trial, key) value is computed before every batch.
        mutates: per ``plan.batches`` index, whether it writes its input in place (default:
            the plan's flag).
    """
    batches = plan.batches
    mutates = mutates if mutates is not None else [
        any(plan.nodes[k].mutates for _, k in pairs) for pairs in batches]
    inputs = [{t: plan.nodes[k].inputs for t, k in pairs} for pairs in batches]
    producer = {pair: b for b, pairs in enumerate(batches) for pair in pairs}
    region_of: dict[int, int] = {}
    regions: list[Region] = []

    def ready(trial: str, key: str) -> int:
        """The level from which the value can be read: 0 when shared, else one past it."""
        if shared_at(trial, key):
            return 0
        b = producer.get((trial, key))
        if b is not None:
            return regions[region_of[b]].level + 1 if b in region_of else levels[b] + 1
        return stage.get((trial, key), 0) + 1

    def written(key: str) -> bool:
        return any(plan.nodes[r].mutates for r in plan.readers[key])

    def wire(b: int, index: int) -> list[tuple[str, int]] | None:
        """Member ``b``'s ports in region ``regions[index]``, or None when it cannot join."""
        r = regions[index]
        trials = tuple(t for t, _ in batches[b])
        if trials != r.trials or mutates[b] or mutates[r.members[0]]:
            return None
        ports, internal = [], False
        arity = len(inputs[b][trials[0]])
        if any(len(inputs[b][t]) != arity for t in trials):
            return None
        for j in range(arity):
            srcs = {producer.get((t, inputs[b][t][j])) for t in trials}
            src = srcs.pop() if len(srcs) == 1 else None
            if src is not None and region_of.get(src) == index:
                if [inputs[b][t][j] for t in trials] != \
                        [dict(batches[src])[t] for t in trials]:
                    return None
                ports.append(("op", src))
                internal = True
                continue
            keys = tuple(inputs[b][t][j] for t in trials)
            if any(producer.get((t, k)) in r.members for t, k in zip(trials, keys)):
                return None  # some models read a member's output here, others not
            if any(ready(t, k) > r.level or written(k) for t, k in zip(trials, keys)):
                return None
            ports.append(("in", keys))
        return ports if internal else None

    for b, pairs in enumerate(batches):
        candidates = []
        for t, _ in pairs:
            for k in inputs[b][t]:
                src = producer.get((t, k))
                if src is not None and src in region_of and region_of[src] not in candidates:
                    candidates.append(region_of[src])
        for index in candidates:
            ports = wire(b, index)
            if ports is not None:
                r = regions[index]
                r.members.append(b)
                r.wiring.append(_positions(r, ports))
                region_of[b] = index
                break
        else:
            r = Region([b], tuple(t for t, _ in pairs), levels[b])
            keys = [tuple(inputs[b][t][j] for t, _ in pairs)
                    for j in range(len(inputs[b][pairs[0][0]]))]
            r.wiring.append(_positions(r, [("in", k) for k in keys]))
            region_of[b] = len(regions)
            regions.append(r)

    for r in regions:  # what is read outside the region: by a cell or another region
        members = set(r.members)
        for m in r.members:
            if any(t in plan.nodes[reader].holders and plan.batched.get((t, reader)) not in members
                   for t, k in batches[m] for reader in plan.readers[k]):
                r.exports.append(m)
    return regions


def _positions(r: Region, ports: list) -> list[tuple[str, int]]:
    """Ports as ``("in", position)`` (adding new outside inputs to ``r.inputs``, each once) or
    ``("op", member)``."""
    out = []
    for kind, value in ports:
        if kind == "op":
            out.append(("op", value))
            continue
        if value not in r.inputs:
            r.inputs.append(value)
        out.append(("in", r.inputs.index(value)))
    return out
