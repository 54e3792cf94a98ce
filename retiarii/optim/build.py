"""A physical group -> one executable ``nn.Module`` that trains several models at once.

:func:`build_group` takes the plan of a group (after the passes: models fed by one data
pipeline) and the models as built alone (``space.build(sample)`` under each trial's seed, as
``TrialRun`` builds them) and returns a :class:`GroupModule`. Its IR (``group.graph``) is one
merged Graph: the data inputs, one cell holding the shared nodes, one cell per model holding
its own nodes, and a dict output keyed by trial::

    x ─▶ shared: x -> conv(frozen) -> relu ─┬─▶ parts.0: fc_a -> output ─┐
                                            └─▶ parts.1: fc_b -> output ─┴─▶ {"a": .., "b": ..}

Each cell is emitted through torch.fx like any model (``retiarii.codegen.to_module``). The
group *adopts* the models' own modules: a part calls the very submodules of the model built
alone, and a shared frozen module is one object that every model of the group now holds. So
``group.model(trial)`` is still that trial's model: its ``parameters()`` (for its own
optimizer), ``state_dict()`` (its checkpoint, in exactly the layout of separate training)
and ``load_state_dict`` are unchanged, and a ``TrialRun`` built around it keeps working.

``group(x, rng={trial: ctx})`` runs the shared cell once under ``torch.no_grad()`` (nothing
in it trains: autograd flows only into each model's own part), then each model's part with
that model's RNG streams swapped in (``ctx()`` is a context manager, e.g. ``TrialRun``'s), so
dropout in model A draws what it draws when A trains alone: shared nodes never draw random
numbers (the plan makes random operations a model's own). A part that writes a value in
place gets its own copy of the shared values it reads.

Example::

    plan = cse(build_plan(batch)).plan
    group = build_group(plan, {t: run.model for t, run in runs.items()})
    outs = group(x, rng={t: run._own_rng for t, run in runs.items()})
    sum(F.cross_entropy(outs[t], y) for t in outs).backward()
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch
from torch import nn

from ..codec import PortRef, encode
from ..codegen import to_module
from ..graph import Graph, Node, Operation
from .plan import LogicalPlan, PlanError, Role

__all__ = ["GroupError", "GroupModule", "build_group"]


class GroupError(PlanError):
    """Models that cannot run as one group (different data pipelines, frozen values that
    differ between them, a model missing)."""


class GroupModule(nn.Module):
    """Several models run as one module; see the module docstring.

    Attributes:
        graph: the merged IR (a Graph: inputs, the ``shared`` cell, one cell per model).
        trials: the trial ids, in plan order (``parts[str(i)]`` is ``trials[i]``'s).
    """

    def __init__(self, graph: Graph, shared: nn.Module, parts: list[nn.Module],
                 reads: list[list[int]], clones: list[bool], trials: tuple[str, ...],
                 models: Mapping[str, nn.Module]):
        super().__init__()
        self.graph = graph
        self.shared = shared
        self.parts = nn.ModuleDict({str(i): p for i, p in enumerate(parts)})
        self.trials = trials
        self._reads, self._clones = reads, clones
        self.__dict__["_models"] = dict(models)  # not submodules: their modules are ours

    def forward(self, *inputs: Any,
                rng: Mapping[str, Callable[[], ContextManager]] | None = None,
                errors: dict[str, Exception] | None = None) -> dict[str, Any]:
        """Every model's output for one batch, ``{trial id: output}``.

        Args:
            inputs: the batch's model inputs (what each model's ``forward`` takes).
            rng: per trial, a function returning a context manager that swaps that trial's
                RNG streams in (``TrialRun._own_rng``); None runs every part in the current
                streams (fine when no model draws random numbers).
            errors: when given, a part that raises is recorded here (``errors[trial]``) and
                left out of the result, and the other parts still run: one model's error
                fails that model alone (the worker's grouped jobs). None: the error propagates.
        """
        with torch.no_grad():  # frozen and weightless only: nothing here trains
            frontier = self.shared(*inputs)  # tuple of the shared values the parts read
        outs: dict[str, Any] = {}
        for i, trial in enumerate(self.trials):
            args = [frontier[j] for j in self._reads[i]]
            if self._clones[i]:  # the part writes in place: not into values others read
                args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            try:
                with rng[trial]() if rng is not None else contextlib.nullcontext():
                    outs[trial] = self.parts[str(i)](*args)
            except Exception as err:
                if errors is None:
                    raise
                errors[trial] = err
        return outs

    def model(self, trial: str) -> nn.Module:
        """The trial's model as built alone (its modules are this group's)."""
        return self._models[trial]

    def parameters_of(self, trial: str) -> Iterator[nn.Parameter]:
        """The trial's parameters in the order of its model built alone (its optimizer's)."""
        return self._models[trial].parameters()

    def state_dict_of(self, trial: str) -> dict[str, torch.Tensor]:
        """The trial's state dict, keys and order as its model built alone."""
        return self._models[trial].state_dict()


# ---- building -----------------------------------------------------------------------------


def _get(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _set(root: nn.Module, path: str, value: Any) -> None:
    """Point ``path`` of ``root`` at ``value`` (a module, parameter or buffer) in place."""
    *parents, leaf = path.split(".")
    owner = root
    for part in parents:
        owner = owner._modules[part]
    if isinstance(value, nn.Module):
        owner._modules[leaf] = value
    elif leaf in owner._parameters:
        owner._parameters[leaf] = value
    elif leaf in owner._buffers:
        owner._buffers[leaf] = value
    else:
        raise GroupError(f"{path!r} is neither a parameter nor a buffer of the model")


def _state(obj: Any) -> dict[str, torch.Tensor]:
    return obj.state_dict(keep_vars=True) if isinstance(obj, nn.Module) else {"": obj}


def _same_values(a: Any, b: Any) -> bool:
    sa, sb = _state(a), _state(b)
    return sa.keys() == sb.keys() and all(
        sa[k].shape == sb[k].shape and sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k])
        for k in sa)


def _emit(graph: Graph, adopt: Callable[[Node], tuple[nn.Module, str] | None],
          device: torch.device | None) -> nn.Module:
    """The cell's fx module, its modules and tensors then replaced by the adopted ones
    (``adopt(node) -> (model, attr)``, None: keep the emitted one, e.g. a constant), and
    what it keeps moved to ``device``, the models' (None: leave it where it was made)."""
    with torch.random.fork_rng(devices=[]):  # emitting inits fresh weights: not in any stream
        module = to_module(graph, "Cell")
    owners = {n.attr for n in graph.nodes if n.kind in ("module", "subgraph")}
    for node in graph.nodes:
        if node.kind not in ("module", "subgraph", "param"):
            continue
        parts = node.attr.split(".")
        if node.kind == "param" and any(".".join(parts[:i]) in owners
                                        for i in range(1, len(parts))):
            continue  # a tensor of an adopted module: adopted with it
        source = adopt(node)
        if source is not None:
            _set(module, node.attr, _get(*source))
    if device is not None:  # only the kept tensors (constants) are elsewhere: made on the CPU
        for owner in module.modules():
            for name, buffer in owner._buffers.items():
                if buffer is not None and buffer.device != device:
                    owner._buffers[name] = buffer.to(device)
    return module


def _device(models: Mapping[str, nn.Module]) -> torch.device | None:
    """Where the models live (a model trains on one device), or None when they hold no
    tensor."""
    for model in models.values():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            return tensor.device
    return None


def _inverse(plan: LogicalPlan) -> dict[str, dict[str, int]]:
    return {t: {k: uid for uid, k in keys.items()} for t, keys in plan.keys.items()}


def build_group(plan: LogicalPlan, models: Mapping[str, nn.Module]) -> GroupModule:
    """One :class:`GroupModule` for every model of ``plan`` (see the module docstring).

    Args:
        plan: the group's plan after the passes (``plan.restrict(group)``); its models must
            share their data pipeline (one of ``plan.groups()``), or be a single model.
        models: trial id -> the model built alone from the plan's graph
            (``space.build(sample)``). The group adopts their modules: shared frozen modules
            become one object held by every model (after checking their values are equal).

    Raises:
        GroupError: the models read different batches, a model is missing, or frozen values
            that the plan shares differ between two models.
    """
    trials = tuple(m.trial_id for m in plan.models)
    missing = [t for t in trials if t not in models]
    if missing:
        raise GroupError(f"no built model for trials {missing}")
    roots = plan.data_roots(trials[0])
    if len(trials) > 1 and any(plan.data_roots(t) != roots or r not in plan.shared
                               for t in trials for r in plan.data_roots(t)):
        raise GroupError(f"trials {list(trials)} do not share one data pipeline (their "
                         f"trainers' data keys differ, or the plan did not merge them): "
                         f"run plan.groups() to split them")
    inv = _inverse(plan)
    graphs = {m.trial_id: m.model.graph for m in plan.models}
    rep_node = {k: graphs[plan.nodes[k].holders[0]].node_by_uid(inv[plan.nodes[k].holders[0]][k])
                for k in plan.shared}

    # 1. One object per shared frozen value: every holder's model now holds the first's.
    for key in plan.shared:
        node = plan.nodes[key]
        if node.role is not Role.FROZEN:
            continue
        first, attr = node.holders[0], rep_node[key].attr
        keep = _get(models[first], attr)
        for other in node.holders[1:]:
            other_attr = graphs[other].node_by_uid(inv[other][key]).attr
            mine = _get(models[other], other_attr)
            if mine is keep:
                continue
            if not _same_values(mine, keep):
                raise GroupError(
                    f"frozen {rep_node[key].name!r} has different values in trials {first} "
                    f"and {other}: frozen values come from the space's base model, so build "
                    f"both from one space (ModelSpace.build) before grouping them")
            _set(models[other], other_attr, keep)

    # 2. The shared cell: the data inputs, then every shared key in plan (topological) order.
    index = {t: i for i, t in enumerate(trials)}
    shared_cell, in_cell = Graph(), {}
    for key in roots:
        src = graphs[trials[0]].node_by_uid(inv[trials[0]][key])
        in_cell[key] = shared_cell.add_node(src.name, src.op.copy())
    cell_attr: dict[str, tuple[str, str]] = {}  # shared cell attr -> (trial, attr in its model)
    for key in plan.nodes:
        if key not in plan.shared or key in in_cell:
            continue
        src, holder = rep_node[key], plan.nodes[key].holders[0]
        op = src.op.copy()
        if op.kind in ("module", "subgraph", "param"):
            op.attr = f"_m{index[holder]}.{src.attr}"  # models' paths may clash: one per model
            cell_attr[op.attr] = (holder, src.attr)
        new = in_cell[key] = shared_cell.add_node(shared_cell.unique_name(src.name), op)
        for port, feed in enumerate(src.inputs):
            shared_cell.connect(in_cell[plan.keys[holder][feed.uid]], new, port)

    # 3. One cell per model: its own nodes, in its own order, fed by the shared values it reads.
    frontier: list[str] = []
    own_cells, reads, clones = [], [], []
    for trial in trials:
        graph, keys = graphs[trial], plan.keys[trial]
        own = [n for n in graph.nodes if keys[n.uid] not in plan.shared
               and not (len(trials) == 1 and keys[n.uid] in roots)]
        needed: list[str] = []
        for node in own:
            for feed in node.inputs:
                k = keys[feed.uid]
                if (k in plan.shared or k in roots) and k not in needed:
                    needed.append(k)
        cell = Graph()
        cell.meta = {"modules": list(graph.meta.get("modules", []))}
        next_uid = max(graph.uids()) + 1
        feeds = {}
        for j, k in enumerate(needed):
            name = _fresh(graph, f"shared_{j}")
            feeds[k] = cell.add_node(name, Operation("input", target=name), uid=next_uid + j)
        for node in own:  # added in the model's order: the cell runs them in that order
            new = cell.add_node(node.name, node.op.copy(), uid=node.uid)
            for port, feed in enumerate(node.inputs):
                k = keys[feed.uid]
                cell.connect(feeds[k] if k in feeds else cell.node_by_uid(feed.uid), new, port)
        for k in needed:
            if k not in frontier:
                frontier.append(k)
        own_cells.append(cell)
        reads.append([frontier.index(k) for k in needed])
        clones.append(any(plan.nodes[keys[n.uid]].mutates for n in own))
    out = shared_cell.add_node("output", Operation("output", args=[encode(
        tuple(PortRef(i) for i in range(len(frontier))))]))
    for i, k in enumerate(frontier):
        shared_cell.connect(in_cell[k], out, i)
    shared_cell.lint()

    # 4. Emit each cell through codegen; adopt the models' modules.
    device = _device(models)
    shared_module = _emit(shared_cell, lambda n: (models[cell_attr[n.attr][0]],
                                                  cell_attr[n.attr][1]), device)
    parts = []
    for trial, cell in zip(trials, own_cells):
        cell.lint()
        parts.append(_emit(cell, lambda n, t=trial: (models[t], n.attr), device))
    merged = _merged_graph(shared_cell, own_cells, reads, trials)
    return GroupModule(merged, shared_module, parts, reads, clones, trials,
                       {t: models[t] for t in trials})


def _fresh(graph: Graph, name: str) -> str:
    while name in graph:
        name = "_" + name
    return name


def _merged_graph(shared: Graph, parts: list[Graph], reads: list[list[int]],
                  trials: tuple[str, ...]) -> Graph:
    """The group as one IR graph: inputs -> shared cell -> one cell per model -> a dict."""
    g = Graph()
    inputs = [g.add_node(n.name, n.op.copy()) for n in shared.input_nodes]
    width = len(shared["output"].inputs)
    cell = g.add_node("shared", Operation("subgraph", args=[encode(PortRef(i))
                                                            for i in range(len(inputs))],
                                          graph=shared, attr="shared"))
    for port, node in enumerate(inputs):
        g.connect(node, cell, port)
    values = []
    for j in range(width):
        item = g.add_node(f"shared_{j}", Operation("function", target="_operator:getitem",
                                                   args=[encode(PortRef(0)), j]))
        g.connect(cell, item, 0)
        values.append(item)
    outs = []
    for i, (part, read) in enumerate(zip(parts, reads)):
        node = g.add_node(f"part_{i}", Operation("subgraph", args=[encode(PortRef(p))
                                                                   for p in range(len(read))],
                                                 graph=part, attr=f"parts.{i}"))
        for port, j in enumerate(read):
            g.connect(values[j], node, port)
        outs.append(node)
    out = g.add_node("output", Operation("output", args=[encode(
        {t: PortRef(i) for i, t in enumerate(trials)})]))
    for i, node in enumerate(outs):
        g.connect(node, out, i)
    return g
