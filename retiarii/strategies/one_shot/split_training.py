"""Training a super-graph split over devices: the runtime of :mod:`retiarii.optim.split`.

A :class:`~retiarii.strategies.one_shot.shared_training.SharedTraining` given a ``memory`` budget
(``device_memory``, bytes per device for the shared weights) holds only part of the pool on its
device. The rest lives in host memory: in the **unit** the segment started from (every rank
loads it; nothing of it is moved to the device unless needed) or **parked** by a rank that
handed a weight on. Where each weight's latest value is follows from the plan alone, so every
rank knows it without asking: on the devices of the ranks that hold it, else parked on the host
of the rank that held it last, else in the unit, else nowhere yet (a new operator starts from
its seeded initial value, the same on every rank).

:class:`SplitRun` runs one segment's schedule on one rank:

* at each window of the plan it moves weights: a rank gets each operator it now needs (weights,
  buffers, optimizer state) from the lowest rank that held it, or from a host copy; what no
  rank needs any more is parked by the lowest rank that held it; then each rank drops what it
  no longer needs. Transfers are point to point (``torch.distributed.send_object_list``), in
  one global order, so no two ranks wait on each other;
* each step, every trained weight of the window's union has its gradient averaged over the
  ranks that used it (:func:`average_named_gradients`: mask and count, as
  :func:`~retiarii.optim.mixed_parallel.average_used_gradients`, lined up by name, a rank
  adding zeros for weights it does not hold), so holders of a weight keep equal values and
  optimizer states;
* at the end, rank 0 gathers every weight's latest value into a whole unit (a weight held by
  several ranks comes from the lowest: its BatchNorm statistics are that rank's, as rank 0's
  are in plain mixed parallelism).

Between segments (evaluation), :func:`ensure` makes a path's operators present from the host
copies, dropping (parking) the least recently used others to stay within the budget.
"""
from __future__ import annotations

import zlib
from collections import defaultdict
from typing import Any

import torch

from ...optim.keyed_state import FORMAT, is_keyed, param_state_to
from ...optim.split import SuperGraphSplit, Window

__all__ = ["SplitRun", "average_named_gradients", "ensure", "full_state", "load_unit",
           "optimizer_slots", "plan_segment"]

Item = dict  # {"entry": a SuperGraph state entry, "optim": {param name: [group, state]}}


# ---- host copies -------------------------------------------------------------------------------


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    return value


def _group_of(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    return {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}


def _pool_item(shared: Any, key: str) -> Item:
    """``key``'s operator as the pool holds it, copied to the host."""
    sg, opt = shared.supergraph, shared.optimizer
    entry = sg.state_dict([key])["entries"][0]
    entry["state"] = _cpu(entry["state"])
    groups = _group_of(opt)
    optim = {}
    for name, p in sg.module(key).named_parameters():
        state = opt.state.get(p)
        optim[f"{key}:{name}"] = [groups.get(id(p), 0), _cpu(dict(state)) if state else None]
    return {"entry": entry, "optim": optim}


class _Unit:
    """The unit a segment started from, indexed by weight key (host memory)."""

    def __init__(self, state: dict | None):
        self.entries: dict[str, dict] = {}
        self.optim: dict[str, dict[str, list]] = defaultdict(dict)
        if state is None:
            return
        if not is_keyed(state["optimizer"]):
            raise ValueError("this one-shot state keeps its optimizer state by position (saved "
                             "before device_memory existed): resume it once without "
                             "device_memory; its next unit can be split")
        self.entries = {e["key"]: e for e in state["supergraph"]["entries"]}
        opt = state["optimizer"]
        for g, group in enumerate(opt["param_groups"]):
            for name in group["params"]:
                self.optim[name.rsplit(":", 1)[0]][name] = [g, opt["state"].get(name)]

    def item(self, key: str) -> Item:
        return {"entry": self.entries[key], "optim": dict(self.optim.get(key, {}))}


def load_unit(shared: Any, state: dict) -> None:
    """Keep ``state`` (a SharedTraining state) as the host copy and load into the pool only
    the operators it holds now (a split super-graph's rank loads the rest as it needs them)."""
    shared._unit = _Unit(state)
    shared._parked = {}
    for key in list(shared.supergraph.keys()):
        if key in shared._unit.entries:
            _load_item(shared, shared._unit.item(key))


def _load_item(shared: Any, item: Item) -> None:
    """Put a host copy of an operator into the pool (and its optimizer state)."""
    sg, opt = shared.supergraph, shared.optimizer
    sg.load_state_dict({"format": 1, "seed": sg.seed, "entries": [item["entry"]]})
    key = item["entry"]["key"]
    params = dict(sg.module(key).named_parameters())
    for full, (group, state) in item["optim"].items():
        p = params.get(full[len(key) + 1:])
        if p is None:
            continue
        for g, members in enumerate(opt.param_groups):
            keep = [q for q in members["params"] if q is not p]
            if g == group:
                keep.append(p)
            members["params"] = keep
        if state:
            opt.state[p] = param_state_to(p, state)
        else:
            opt.state.pop(p, None)


def _latest(shared: Any, key: str) -> Item:
    """This rank's latest copy of ``key``: its pool, a parked copy, or the unit."""
    if key in shared.supergraph:
        return _pool_item(shared, key)
    if key in shared._parked:
        return shared._parked[key]
    return shared._unit.item(key)


def _take(shared: Any, key: str) -> None:
    """Load ``key`` from this rank's host copies into the pool, if it has one."""
    if key in shared._parked:
        _load_item(shared, shared._parked.pop(key))
    elif key in shared._unit.entries:
        _load_item(shared, shared._unit.item(key))


def full_state(shared: Any) -> tuple[dict, dict]:
    """``(supergraph state, keyed optimizer state)`` of every weight this rank knows (its
    pool, parked copies, the unit), the unit's order first, then the rest by key."""
    keys = list(shared._unit.entries)
    seen = set(keys)
    keys += sorted(k for k in [*shared.supergraph.keys(), *shared._parked] if k not in seen)
    return _assemble(shared, {k: _latest(shared, k) for k in keys})


def _assemble(shared: Any, items: dict[str, Item]) -> tuple[dict, dict]:
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []}
              for g in shared.optimizer.param_groups]
    state: dict[str, dict] = {}
    entries = []
    for key, item in items.items():
        entries.append(item["entry"])
        for name, (group, s) in item["optim"].items():
            groups[group]["params"].append(name)
            if s:
                state[name] = s
    sg = {"format": 1, "seed": shared.supergraph.seed, "entries": entries}
    return sg, {"format": FORMAT, "param_groups": groups, "state": state}


# ---- gradients ---------------------------------------------------------------------------------


def average_named_gradients(layout: list[tuple[str, tuple, torch.dtype]],
                            params: dict[str, torch.nn.Parameter], group: Any,
                            device: torch.device) -> None:
    """Average each named parameter's gradient over the ranks that used it in this step.

    ``layout`` is the same list of ``(name, shape, dtype)`` on every rank (the trained weights
    of the window's union); ``params`` the ones this rank holds. A rank adds zeros (and a use
    flag 0) for the others. Afterwards a held parameter used by ``c > 0`` ranks has the sum of
    their gradients over ``c``; one used by none has ``grad = None`` (the optimizer skips it
    on every holder)."""
    import torch.distributed as dist

    from ...optim.mixed_parallel import BUCKET_ELEMENTS, size_buckets

    by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
    for i, (_, _, dtype) in enumerate(layout):
        by_dtype[dtype].append(i)
    for dtype in sorted(by_dtype, key=str):
        members = by_dtype[dtype]
        sizes = [int(torch.Size(layout[i][1]).numel()) for i in members]
        numel = dict(zip(members, sizes))
        for bucket in size_buckets(members, sizes, BUCKET_ELEMENTS):
            numels = [numel[i] for i in bucket]
            flat = torch.zeros(sum(numels) + len(bucket), dtype=dtype, device=device)
            grads = flat[:sum(numels)].split(numels)
            flags = flat[sum(numels):]
            for j, i in enumerate(bucket):
                p = params.get(layout[i][0])
                if p is not None and p.grad is not None:
                    grads[j].copy_(p.grad.reshape(-1))
                    flags[j] = 1
            dist.all_reduce(flat, group=group)
            used = flags.round().to(torch.int64).cpu().tolist()
            for j, i in enumerate(bucket):
                p = params.get(layout[i][0])
                if p is None:
                    continue
                if used[j] == 0:
                    p.grad = None
                else:
                    p.grad = grads[j].view_as(p).div(used[j])


def _check_layout(layout: list, group: Any, device: torch.device) -> None:
    """Every rank computed the same layout, or a clear error on every rank (a mismatch would
    add up unrelated gradients)."""
    import torch.distributed as dist

    mine = torch.tensor([len(layout), zlib.crc32(repr([(n, s, str(d)) for n, s, d in layout])
                                                 .encode())], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    if any(t.tolist() != every[0].tolist() for t in every):
        raise RuntimeError("the ranks of a split super-graph planned different windows: every "
                           "rank must draw the same schedule (the same seed and segment)")


# ---- a segment's run -----------------------------------------------------------------------


class SplitRun:
    """One rank's part of a split segment: see the module docstring.

    Args:
        shared: this rank's SharedTraining (with a unit loaded by :func:`load_unit`).
        plan: the segment's :class:`~retiarii.optim.split.SuperGraphSplit`.
        samples: the schedule the plan was made from (``samples[i * world + r]``).
        ops: every weight key of the schedule -> its OpKey.
        ctx: the segment context (rank, world, group, device).
    """

    def __init__(self, shared: Any, plan: SuperGraphSplit, samples: list[dict],
                 ops: dict, ctx: Any):
        self.shared, self.plan, self.samples, self.ops, self.ctx = shared, plan, samples, ops, ctx
        self.rank, self.world = ctx.rank, ctx.world
        # where each weight's latest value is (the same bookkeeping on every rank)
        start = frozenset(shared.supergraph.keys())  # every rank set up and loaded alike
        self.holders: dict[str, set[int]] = {k: set(range(self.world)) for k in start}
        self.parked_on: dict[str, int] = {}
        self.window: Window | None = None
        self.layout: list = []
        self._params: dict[str, torch.nn.Parameter] = {}
        self._next = 0

    def path(self, step: int) -> dict:
        """This rank's sample for ``step`` (moving weights first when a window begins)."""
        while self.window is None or step >= self.window.start + self.window.steps:
            self._enter(self.plan.windows[self._next])
            self._next += 1
        offset = step - self.window.start
        return self.samples[self.window.paths[self.rank][offset]]

    def _held(self, r: int) -> set[str]:
        return {k for k, rs in self.holders.items() if r in rs}

    def _enter(self, window: Window) -> None:
        shared, me = self.shared, self.rank
        now = [self._held(r) for r in range(self.world)]
        moves: dict[tuple[int, int], list[str]] = defaultdict(list)
        for r in range(self.world):
            for k in sorted(window.held[r] - now[r]):
                if self.holders.get(k):
                    moves[(min(self.holders[k]), r)].append(k)
                elif k in self.parked_on and self.parked_on[k] != r:
                    moves[(self.parked_on[k], r)].append(k)
        leaving = sorted(k for k, rs in self.holders.items()
                         if rs and not any(k in h for h in window.held))
        received: dict[str, Item] = {}
        if self.world > 1:
            import torch.distributed as dist

            for (src, dst), keys in sorted(moves.items()):
                if me == src:
                    dist.send_object_list([{k: _latest(shared, k) for k in keys}], dst,
                                          group=self.ctx.group)
                elif me == dst:
                    box = [None]
                    dist.recv_object_list(box, src, group=self.ctx.group)
                    received.update(box[0])
        for k in leaving:
            parker = min(self.holders[k])
            self.parked_on[k] = parker
            if parker == me:
                shared._parked[k] = _pool_item(shared, k)
        shared.supergraph.drop(sorted(now[me] - window.held[me]))
        for k in sorted(window.held[me] - now[me]):
            if k in received:
                _load_item(shared, received[k])
            elif not self.holders.get(k):
                _take(shared, k)  # parked here or in the unit; else new (built by path())
        for k in list(shared._parked):  # a parked copy taken back by another rank stays valid
            if any(k in h for h in window.held) and self.parked_on.get(k) == me:
                del shared._parked[k]  # (a device holds the latest value now)
        for k in [k for k in self.parked_on if any(k in h for h in window.held)]:
            del self.parked_on[k]
        self.holders = {k: {r for r in range(self.world) if k in window.held[r]}
                        for k in set().union(*window.held)}
        for i in window.paths[me]:
            shared.net(self.samples[i])  # builds the window's paths (new operators seeded)
        self.layout = sorted({shape for k in set().union(*window.held)
                              for shape in shared.supergraph.parameter_shapes(self.ops[k])})
        if self.world > 1:
            _check_layout(self.layout, self.ctx.group, self.ctx.device)
        # the pool holds the window's operators until the next window: named once per window,
        # not once per step
        self._params = dict(shared.supergraph.named_parameters())
        self.window = window

    def params(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters by name during the current window."""
        return self._params

    def finish(self) -> None:
        """Rank 0 gathers every weight's latest value into a whole unit, and every rank takes
        it as its host copy (so ``state_dict`` is the whole super-graph, and evaluations after
        training, ENAS's controller steps, see the same weights on every rank); the operators a
        rank still holds are reloaded from it (BatchNorm statistics: the lowest holder's)."""
        shared, me = self.shared, self.rank
        known = list(shared._unit.entries)
        seen = set(known)
        known += sorted(k for k in [*self.holders, *self.parked_on] if k not in seen)
        owner = {}
        for k in known:
            if self.holders.get(k):
                owner[k] = min(self.holders[k])
            elif k in self.parked_on:
                owner[k] = self.parked_on[k]
            else:
                owner[k] = 0  # in the unit, on every rank
        received: dict[str, Item] = {}
        if self.world > 1:
            import torch.distributed as dist

            for src in range(1, self.world):
                keys = [k for k in known if owner[k] == src]
                if not keys:
                    continue
                if me == src:
                    dist.send_object_list([{k: _latest(shared, k) for k in keys}], 0,
                                          group=self.ctx.group)
                elif me == 0:
                    box = [None]
                    dist.recv_object_list(box, src, group=self.ctx.group)
                    received.update(box[0])
        whole = None
        if me == 0:
            items = {k: received[k] if k in received else _latest(shared, k) for k in known}
            whole = _assemble(shared, items)
        if self.world > 1:
            import torch.distributed as dist

            box = [whole]
            dist.broadcast_object_list(box, 0, group=self.ctx.group)
            whole = box[0]
        sg, opt = whole
        shared._unit = _Unit({"supergraph": sg, "optimizer": opt})
        shared._parked = {}
        for key in list(shared.supergraph.keys()):
            if key in shared._unit.entries:
                _load_item(shared, shared._unit.item(key))


def optimizer_slots(optimizer: torch.optim.Optimizer) -> int:
    """State tensors per parameter ``optimizer`` keeps (SGD with momentum 1, Adam 2, ...)."""
    group = optimizer.param_groups[0]
    name = type(optimizer).__name__
    if name == "SGD":
        return 1 if group.get("momentum", 0) else 0
    if name in ("RMSprop",):
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))
    if name in ("Adagrad", "Rprop"):
        return 1 if name == "Adagrad" else 2
    return 2  # Adam, AdamW, NAdam, RAdam, Adamax, ...: two moments (the safe side otherwise)


def plan_segment(shared: Any, samples: list[dict], ctx: Any) -> "SplitRun":
    """Plan a segment's schedule (``samples[i * world + r]``: rank r's model at step i) for
    ``shared.memory`` and return this rank's :class:`SplitRun`."""
    from ...optim.split import split_paths

    sg = shared.supergraph
    slots = optimizer_slots(shared.optimizer)
    ops: dict = {}
    costs = []
    sizes: dict[str, int] = {}
    for sample in samples:
        mine = sg.ops_of(sample)
        for key, op in mine.items():
            if key not in sizes:
                ops[key] = op
                sizes[key] = sg.training_bytes(op, slots)
        costs.append({k: sizes[k] for k in mine})
    plan = split_paths(costs, ctx.world, shared.memory)
    return SplitRun(shared, plan, samples, ops, ctx)


def ensure(shared: Any, sample: Any, ops: dict) -> None:
    """Make the operators of a path present in the pool from this rank's host copies,
    parking the least recently used others when the pool would pass ``shared.memory``."""
    sg = shared.supergraph
    need = [k for k in ops if k not in sg]
    if not need:
        return
    size = {k: sg.training_bytes(sg.op(k)) for k in sg.keys()}
    want = sum(sg.training_bytes(ops[k]) for k in need)
    spare = [k for k in sg.keys() if k not in ops]  # the longest held first
    while spare and sum(size.values()) + want > shared.memory:
        k = spare.pop(0)
        shared._parked[k] = _pool_item(shared, k)
        sg.drop([k])
        del size[k]
    for k in need:
        _take(shared, k)
