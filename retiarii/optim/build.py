"""A physical group -> one executable ``nn.Module`` that trains several models at once.

:func:`build_group` takes the plan of a group (after the passes: models fed by one data
pipeline) and the models as built alone (``space.build(sample)`` under each trial's seed, as
``TrialRun`` builds them) and returns a :class:`GroupModule`. Its IR (``group.graph``) is one
merged Graph: the data inputs, one cell holding the shared nodes, one cell per model holding
its own nodes, and a dict output keyed by trial::

    x ─▶ shared: x -> conv(frozen) -> relu ─┬─▶ parts.0: fc_a -> output ─┐
                                            └─▶ parts.1: fc_b -> output ─┴─▶ {"a": .., "b": ..}

Each cell is emitted through torch.fx like any model and *adopts* the models' own modules
(cell_emit.py): a part calls the very submodules of the model built alone, and a shared frozen
module is one object that every model of the group now holds. So ``group.model(trial)`` is
still that trial's model: its ``parameters()`` (for its own optimizer), ``state_dict()`` (its
checkpoint, in exactly the layout of separate training) and ``load_state_dict`` are
unchanged, and a ``TrialRun`` built around it keeps working. How the group runs a step (the
shared cell once, each part in its trial's RNG streams, batched calls) is group_module.py's.

**Batched operators** (``plan.batches``, :mod:`retiarii.optim.batching`). A model's own nodes
are cut into *stages* at the batched operators it holds: a cell per model and stage; between
two stages each batch runs once on its models' inputs concatenated along dim 0. A node's
stage is never below its predecessor's in its model's order, so every model still runs its
own nodes, random draws included, in the order it runs them alone::

    shared: x -> l1* ─┬─▶ parts.0_0: ad_a ─┐
                      └───────────────────-┴─▶ batch_0: l2*(cat) ─▶ split ─▶ parts.0_1, parts.1_1

Example::

    plan = cse(build_plan(batch)).plan
    group = build_group(plan, {t: run.model for t, run in runs.items()})
    outs = group(x, rng={t: run._own_rng for t, run in runs.items()})
    sum(F.cross_entropy(outs[t], y) for t in outs).backward()
"""
from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from ..codec import PortRef, encode
from ..graph import Graph, Node, Operation
from .cell_emit import emit_cell, get_path, models_device, same_values, set_path
from .group_graph import Batch, Cell, merged_graph
from .group_module import GroupError, GroupModule
from .plan import LogicalPlan, PlanError, Role, may_draw_random
from .regions import Region, batch_regions
from .state import StateMirror, check_untied, state_digests, with_states

__all__ = ["GroupError", "GroupModule", "build_group"]


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
    # Frozen BatchNorms are shared among the models whose running statistics are equal now
    # (state.py): re-keyed by their values, the others' copies stay their own.
    plan = with_states(plan, state_digests(plan, models)).plan
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

    # 1. One object per shared frozen value: every holder's model now holds the first's. A
    # frozen module with running statistics stays each model's own object (their values are
    # each model's state, saved in its checkpoint): the group runs the first holder's and
    # copies its statistics into the others' after each run (a StateMirror).
    mirrors: list[StateMirror] = []
    for key in plan.shared:
        node = plan.nodes[key]
        if node.role is not Role.FROZEN:
            continue
        first, attr = node.holders[0], rep_node[key].attr
        keep = get_path(models[first], attr)
        copies: list[nn.Module] = []
        for other in node.holders[1:]:
            other_attr = graphs[other].node_by_uid(inv[other][key]).attr
            mine = get_path(models[other], other_attr)
            if mine is keep:
                continue
            if not same_values(mine, keep):
                raise GroupError(
                    f"frozen {rep_node[key].name!r} has different values in trials {first} "
                    f"and {other}: frozen values come from the space's base model, so build "
                    f"both from one space (ModelSpace.build) before grouping them")
            if node.stateful:
                copies.append(mine)
            else:
                set_path(models[other], other_attr, keep)
        if node.stateful:
            try:
                check_untied(plan, models, key)
            except PlanError as err:
                raise GroupError(str(err)) from None
        if copies:
            mirrors.append(StateMirror(keep, copies))

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

    # 3. The batched calls: one object per batched frozen module (values checked equal).
    def shared_at(trial: str, key: str) -> bool:
        return key in plan.shared or (len(trials) == 1 and key in roots)

    srcs: list[Node] = []  # per plan batch: its operator's node in its first model
    mutates: list[bool] = []  # per plan batch: writes its input in place (inside a Sequential too)
    for pairs in plan.batches:
        first, fkey = pairs[0]
        src = graphs[first].node_by_uid(inv[first][fkey])
        keep = get_path(models[first], src.attr) if src.kind == "module" else None
        for other, okey in (pairs[1:] if keep is not None else ()):  # a function: no values
            attr = graphs[other].node_by_uid(inv[other][okey]).attr
            if get_path(models[other], attr) is not keep:
                if not same_values(get_path(models[other], attr), keep):
                    raise GroupError(f"frozen {src.name!r} has different values in trials "
                                     f"{first} and {other}: build both from one space")
                set_path(models[other], attr, keep)
        srcs.append(src)
        mutates.append(plan.nodes[fkey].mutates or (keep is not None and any(
            getattr(m, "inplace", False) is True for m in keep.modules())))
    levels = [0] * len(plan.batches)  # per plan batch: the stage before which it runs

    # 4. Stages: a model's own nodes between two batched calls form one cell. A node's stage
    # is at least its inputs' (a batched output's: the batch's level) and its predecessor's in
    # the model's order (so each model runs its nodes, random draws included, in its order);
    # a batch's level is one more than its inputs' stages in every model holding it.
    stage: dict[tuple[str, str], int] = {}
    bound = sum(len(g.nodes) for g in graphs.values()) + 2
    for _ in range(bound):
        changed = False
        for trial in trials:
            keys, prev = plan.keys[trial], 0
            for node in graphs[trial].nodes:
                k = keys[node.uid]
                if shared_at(trial, k):
                    continue
                need = max([prev] + [_level(stage, levels, plan, trial, keys[f.uid])
                                     for f in node.inputs])
                b = plan.batched.get((trial, k))
                if b is not None:
                    if need + 1 > levels[b]:
                        levels[b], changed = need + 1, True
                    prev = max(prev, levels[b])
                    continue
                if stage.get((trial, k)) != need:
                    stage[(trial, k)], changed = need, True
                prev = need
        if not changed:
            break
    else:
        raise GroupError(f"the batched operators of trials {list(trials)} cannot be ordered "
                         f"consistently in every model: plan them without batching")

    # 4b. Batched regions (regions.py): a chain of batched operators over the same models is
    # one call, split back only where something outside it reads.
    batches = [_region_batch(f"batch_{i}", r, plan, srcs, mutates, models)
               for i, r in enumerate(batch_regions(plan, levels, stage, shared_at, mutates))]

    # 5. One cell per model and stage: its own nodes of that stage, in its own order.
    frontier: list[str] = [k for bt in batches for t, srcs, _ in bt.pairs for k in srcs
                           if shared_at(t, k)]
    frontier = list(dict.fromkeys(frontier))  # the shared values the batches read, once each
    cells: list[Cell] = []
    cell_graphs: list[Graph] = []
    for i, trial in enumerate(trials):
        graph, keys = graphs[trial], plan.keys[trial]
        own = [n for n in graph.nodes if not shared_at(trial, keys[n.uid])
               and (trial, keys[n.uid]) not in plan.batched]
        batch_reads = {k for bt in batches for p in bt.pairs if p[0] == trial for k in p[1]}
        for s in sorted({stage[(trial, keys[n.uid])] for n in own}):
            nodes = [n for n in own if stage[(trial, keys[n.uid])] == s]
            inside = {keys[n.uid] for n in nodes}
            needed: list[str] = []
            for node in nodes:
                for feed in node.inputs:
                    k = keys[feed.uid]
                    if k not in inside and k not in needed:
                        needed.append(k)
            later = {keys[f.uid] for n in own if stage[(trial, keys[n.uid])] > s
                     for f in n.inputs} | batch_reads
            exports = [keys[n.uid] for n in nodes if keys[n.uid] in later]
            final = any(n.kind == "output" for n in nodes)
            if final and exports:
                raise GroupError(f"trial {trial}: values computed with its output are read "
                                 f"later: plan it without batching")
            cell = Graph()
            cell.meta = {"modules": list(graph.meta.get("modules", []))}
            next_uid = max(graph.uids()) + 1
            feeds = {}
            for j, k in enumerate(needed):
                name = _fresh(graph, f"shared_{j}")
                feeds[k] = cell.add_node(name, Operation("input", target=name), uid=next_uid + j)
            for node in nodes:  # added in the model's order: the cell runs them in that order
                new = cell.add_node(node.name, node.op.copy(), uid=node.uid)
                for port, feed in enumerate(node.inputs):
                    k = keys[feed.uid]
                    cell.connect(feeds[k] if k in feeds else cell.node_by_uid(feed.uid), new, port)
            if not final:
                out = cell.add_node(_fresh(graph, "output"), Operation("output", args=[encode(
                    tuple(PortRef(p) for p in range(len(exports))))]))
                for p, k in enumerate(exports):
                    cell.connect(cell.node_by_uid(inv[trial][k]), out, p)
            for k in needed:
                if shared_at(trial, k) and k not in frontier:
                    frontier.append(k)
            cell.lint()
            own_reads = [not shared_at(trial, k) and (trial, k) not in plan.batched for k in needed]
            name = f"{i}" if s == 0 and final else f"{i}_{s}"
            module = emit_cell(cell, lambda n, t=trial: (models[t], n.attr), models_device(models))
            cells.append(Cell(name, trial, s, module, needed, own_reads, exports, final,
                               any(plan.nodes[keys[n.uid]].mutates for n in nodes),
                               may_draw_random(cell)))
            cell_graphs.append(cell)
    out = shared_cell.add_node("output", Operation("output", args=[encode(
        tuple(PortRef(i) for i in range(len(frontier))))]))
    for i, k in enumerate(frontier):
        shared_cell.connect(in_cell[k], out, i)
    shared_cell.lint()

    # 6. Emit the shared cell through codegen; adopt the models' modules.
    shared_module = emit_cell(shared_cell, lambda n: (models[cell_attr[n.attr][0]],
                                                      cell_attr[n.attr][1]), models_device(models))
    merged = merged_graph(shared_cell, frontier, cells, cell_graphs, batches, trials)
    return GroupModule(merged, shared_module, frontier, cells, batches, trials,
                       {t: models[t] for t in trials}, plan, mirrors)


def _region_batch(name: str, region: Region, plan: LogicalPlan, srcs: list[Node],
                  mutates: list[bool], models: Mapping[str, nn.Module]) -> Batch:
    """One batched call of ``region``: its operators (each as in its first model, whose
    modules every model of the region now holds) in one cell graph, ``(x_0, ..., x_m) ->
    (the exported members' outputs)``, emitted through codegen."""
    cell = Graph()
    taken = {srcs[m].name for m in region.members}
    ins = []
    for j in range(len(region.inputs)):
        label = "x" if len(region.inputs) == 1 else f"x{j}"
        while label in taken:
            label = "_" + label
        taken.add(label)
        ins.append(cell.add_node(label, Operation("input", target=label)))
    ops: dict[int, Node] = {}
    for m, ports in zip(region.members, region.wiring):
        ops[m] = node = cell.add_node(srcs[m].name, srcs[m].op.copy())
        for port, (kind, value) in enumerate(ports):
            cell.connect(ins[value] if kind == "in" else ops[value], node, port)
    out = cell.add_node(_fresh(cell, "output"), Operation("output", args=[encode(
        tuple(PortRef(p) for p in range(len(region.exports))))]))
    for p, m in enumerate(region.exports):
        cell.connect(ops[m], out, p)
    cell.lint()
    first = region.trials[0]
    module = emit_cell(cell, lambda n: (models[first], n.attr), models_device(models))
    pairs = [(t, tuple(keys[i] for keys in region.inputs),
              tuple(dict(plan.batches[m])[t] for m in region.exports))
             for i, t in enumerate(region.trials)]
    return Batch(name, region.level, module, pairs, any(mutates[m] for m in region.members),
                 cell, len(region.members))


def _level(stage: dict, levels: list[int], plan: LogicalPlan, trial: str, key: str) -> int:
    """When a value of ``trial`` is ready: a shared value at once (0), an own value at its
    node's stage, a batched output at its batch's level."""
    b = plan.batched.get((trial, key))
    if b is not None:
        return levels[b]
    return stage.get((trial, key), 0)


def _fresh(graph: Graph, name: str) -> str:
    while name in graph:
        name = "_" + name
    return name
