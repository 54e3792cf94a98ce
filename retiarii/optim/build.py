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

**Batched operators** (``plan.batches``, :mod:`retiarii.optim.batching`). A model's own nodes
are cut into *stages* at the batched operators it holds: a cell per model and stage. Between
two stages each batch runs once on its models' inputs concatenated along dim 0 (trial
order) and is split back by each model's batch size. Its weights are frozen
(``requires_grad=False``), and it runs under ``torch.no_grad()`` only when no input needs a
gradient: a model's adapter *before* a frozen layer gets its gradient through the batched
call. A node's stage is never below its predecessor's in its model's order, so every model
still runs its own nodes, random draws included, in the order it runs them alone::

    shared: x -> l1* ─┬─▶ parts.0_0: ad_a ─┐
                      └───────────────────-┴─▶ batch_0: l2*(cat) ─▶ split ─▶ parts.0_1, parts.1_1

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
from . import emit_cache
from .group_graph import Batch, Cell, merged_graph
from .plan import LogicalPlan, PlanError, Role, may_draw_random
from .regions import Region, batch_regions
from .state import StateMirror, SyncHook, check_untied, state_digests, with_states

__all__ = ["GroupError", "GroupModule", "build_group"]


class GroupError(PlanError):
    """Models that cannot run as one group (different data pipelines, frozen values that
    differ between them, a model missing)."""


class GroupModule(nn.Module):
    """Several models run as one module; see the module docstring.

    Attributes:
        graph: the merged IR (a Graph: inputs, the ``shared`` cell, the batched cells, one
            cell per model and stage).
        trials: the trial ids, in plan order.
        plan: the plan it was built from, its frozen BatchNorms keyed by the running
            statistics the models held (optim/state.py): what it really shares.
        holds_state: the shared cell updates running statistics (a frozen BatchNorm in
            train mode): it must run here, in order, not ahead on another device.
    """

    def __init__(self, graph: Graph, shared: nn.Module, frontier: list[str],
                 cells: list[Cell], batches: list[Batch], trials: tuple[str, ...],
                 models: Mapping[str, nn.Module], plan: LogicalPlan | None = None,
                 mirrors: list[StateMirror] | None = None):
        super().__init__()
        self.graph = graph
        self.plan = plan
        self.holds_state = bool(mirrors) or (plan is not None and any(
            plan.nodes[k].stateful for k in plan.shared))
        if mirrors:  # after every call of the shared cell, whoever calls it (a measurement
            # times it alone): each holder's running statistics, as if it ran alone
            shared.register_forward_hook(SyncHook(list(mirrors)))
        self.shared = shared
        self.parts = nn.ModuleDict({c.name: c.module for c in cells})
        self.batched = nn.ModuleDict({b.name: b.module for b in batches})
        self.trials = trials
        self._frontier, self._cells, self._batches = frontier, cells, batches
        self._stages = max([c.stage for c in cells] + [b.level for b in batches] + [0]) + 1
        # The run order, stage by stage: a stage's batches, then its cells (Batch or Cell).
        self._order: list[Batch | Cell] = [
            part for stage in range(self._stages)
            for part in ([b for b in batches if b.level == stage]
                         + [c for c in cells if c.stage == stage])]
        self.__dict__["_models"] = dict(models)  # not submodules: their modules are ours

    def forward(self, *inputs: Any,
                rng: Mapping[str, Callable[[], ContextManager]] | None = None,
                errors: dict[str, Exception] | None = None,
                common: tuple | None = None) -> dict[str, Any]:
        """Every model's output for one batch, ``{trial id: output}``.

        Args:
            inputs: the batch's model inputs (what each model's ``forward`` takes).
            rng: per trial, a function returning a context manager that swaps that trial's
                RNG streams in (``TrialRun._own_rng``); None runs every part in the current
                streams (fine when no model draws random numbers).
            errors: when given, a part that raises is recorded here (``errors[trial]``) and
                left out of the result, and the other parts still run: one model's error
                fails that model alone (the worker's grouped jobs). None: the error propagates.
            common: what ``self.shared(*inputs)`` returns, computed elsewhere (a dedicated
                device, one batch ahead: engine/dedicated.py); None computes it here.
        """
        if common is None:
            with torch.no_grad():  # frozen and weightless only: nothing here trains
                common = self.shared(*inputs)
        common = dict(zip(self._frontier, common))
        env: dict[str, dict[str, Any]] = {t: {} for t in self.trials}  # trial -> key -> value
        outs: dict[str, Any] = {}
        failed: set[str] = set()
        joined: dict[tuple[int, ...], torch.Tensor] = {}  # see _run_batch
        for cell in self._order:
            if isinstance(cell, Batch):
                _run_batch(cell, common, env, failed, joined)
                continue
            if cell.trial in failed:
                continue
            args = [env[cell.trial][k] if k in env[cell.trial] else common[k]
                    for k in cell.reads]
            if cell.clones:  # the cell writes in place: not into values others read
                args = [a.clone() if isinstance(a, torch.Tensor) and not own else a
                        for a, own in zip(args, cell.own_reads)]
            try:
                with rng[cell.trial]() if rng is not None and cell.random \
                        else contextlib.nullcontext():
                    result = cell.module(*args)
            except Exception as err:
                if errors is None:
                    raise
                errors[cell.trial] = err
                failed.add(cell.trial)
                continue
            if cell.final:
                outs[cell.trial] = result
            else:
                env[cell.trial].update(zip(cell.exports, result))
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


def _run_batch(batch: Batch, common: dict, env: dict, failed: set[str], joined: dict) -> None:
    """Concatenate the live models' inputs (per input position), call the region once, split
    each exported output by each model's batch size.

    Frozen weights get no gradient (``requires_grad=False``), but a model's trainable part
    upstream (an adapter before this layer) must get one *through* it: the models with an
    input that needs a gradient run as one call with autograd, the others as one call under
    ``no_grad`` (a model whose adapter comes later must not pay for a backward pass here).
    ``joined`` maps the ids of an earlier call's split outputs to their concatenation, so a
    value split by one region and read whole by the next is not concatenated again."""
    live = [(t, srcs, outs) for t, srcs, outs in batch.pairs if t not in failed]
    xs = [[env[t][k] if k in env[t] else common[k] for k in srcs] for t, srcs, _ in live]
    grad = [torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                            for x in args) for args in xs]
    for needs in (True, False):
        part = [i for i, g in enumerate(grad) if g is needs]
        if not part:
            continue
        with torch.set_grad_enabled(needs):
            ys = _call(batch, [xs[i] for i in part],
                       [[k in env[live[i][0]] for k in live[i][1]] for i in part], joined)
        for i, y in zip(part, ys):
            env[live[i][0]].update(zip(live[i][2], y))


def _concatenable(xs: list[list]) -> bool:
    """Whether the models' inputs concatenate into one call that computes each model's values:
    tensors of one dtype and device, per input position the same shape past dim 0, and per
    model every input of the same rank and dim 0 (its batch: no broadcasting over it)."""
    first = xs[0][0]
    if not all(isinstance(x, torch.Tensor) and x.dim() > 0 and x.dtype == first.dtype
               and x.device == first.device for args in xs for x in args):
        return False
    return all(x.dim() == args[0].dim() and x.shape[0] == args[0].shape[0]
               and x.shape[1:] == xs[0][j].shape[1:]
               for args in xs for j, x in enumerate(args))


def _call(batch: Batch, xs: list[list], mine: list[list[bool]], joined: dict) -> list[tuple]:
    """``xs[i]``: model i's inputs; ``mine[i][j]``: whether input j is model i's own value
    (a shared one must not change under the others). Returns per model its exported
    outputs."""
    if not _concatenable(xs):  # one call per model, as alone: the region acts per example
        return [batch.module(*[x if own or not batch.mutates else x.clone()
                               for x, own in zip(args, owns)]) for args, owns in zip(xs, mine)]
    wholes = []
    for j in range(len(xs[0])):  # per input position: n x (B_i, ...) -> (sum B_i, ...)
        whole = joined.get(tuple(id(args[j]) for args in xs))
        if whole is None or batch.mutates:
            whole = torch.cat([args[j] for args in xs])
        wholes.append(whole)
    sizes = [args[0].shape[0] for args in xs]
    per_model: list[list] = [[] for _ in xs]
    # -> n x (B_i, ...): split's views, whose backward is one concatenation (narrow views
    # would each build a full-size zero gradient). Nothing writes them in place: the pass
    # batches no operator whose output a reader writes.
    for out in batch.module(*wholes):
        ys = out.split(sizes)
        joined[tuple(id(y) for y in ys)] = out
        for i, y in enumerate(ys):
            per_model[i].append(y)
    return [tuple(y) for y in per_model]


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
    owners = {n.attr for n in graph.nodes if n.kind in ("module", "subgraph")}
    sources = []
    for node in graph.nodes:
        if node.kind not in ("module", "subgraph", "param"):
            continue
        parts = node.attr.split(".")
        if node.kind == "param" and any(".".join(parts[:i]) in owners
                                        for i in range(1, len(parts))):
            continue  # a tensor of an adopted module: adopted with it
        sources.append((node.attr, adopt(node)))
    # Everything adopted: the cached code of an equal cell serves (emit_cache.py).
    key, module = emit_cache.lookup(graph) \
        if all(source is not None for _, source in sources) else (None, None)
    fresh = module is None
    if fresh:
        with torch.random.fork_rng(devices=[]):  # fresh weights: not in any trial's stream
            module = to_module(graph, "Cell")
    for attr, source in sources:
        if source is not None:
            _set(module, attr, _get(*source))
    if device is not None:  # only the kept tensors (constants) are elsewhere: made on the CPU
        for owner in module.modules():
            for name, buffer in owner._buffers.items():
                if buffer is not None and buffer.device != device:
                    owner._buffers[name] = buffer.to(device)
    _direct_calls(module)
    if fresh and key is not None:
        emit_cache.keep(key, module, graph)
    return module


def _direct_calls(module: nn.Module) -> None:
    """Let each fx module of the cell call its submodules by one flat name.

    fx's code reaches a submodule ``backbone.layers.5.body.0.0`` by one lookup per part, each
    a ``Module.__getattr__`` (six per call; about a hundred per call of a batched region of
    MobileNetV2 blocks). Each called submodule whose target has a dot is also put in the fx
    module's instance dict under a flat name (found by plain attribute lookup, before
    ``__getattr__``) and called by it. Not registered: the hierarchy alone holds the modules
    for ``modules()``, ``state_dict()`` and ``.to()``, which move tensors, never modules, so
    the flat names keep pointing at the right objects."""
    for gm in [m for m in module.modules() if isinstance(m, torch.fx.GraphModule)]:
        # A copy of a cached cell (emit_cache.py) has its code already flat: point its flat
        # names at its own submodules, kept by name here.
        called = gm.__dict__.setdefault("_flat_calls", {})  # flat name -> target
        for name, target in called.items():
            gm.__dict__[name] = gm.get_submodule(target)
        flat: dict[str, str] = {}  # target -> its flat name
        for node in gm.graph.nodes:
            if node.op != "call_module" or "." not in node.target:
                continue
            if node.target not in flat:
                name = "_call_" + node.target.replace(".", "_")
                while hasattr(gm, name):  # taken (by another target's flat name): another
                    name += "_"
                gm.__dict__[name] = gm.get_submodule(node.target)
                flat[node.target], called[name] = name, node.target
            node.target = flat[node.target]
        if flat:
            gm.recompile()


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
        keep = _get(models[first], attr)
        copies: list[nn.Module] = []
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
            if node.stateful:
                copies.append(mine)
            else:
                _set(models[other], other_attr, keep)
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
        keep = _get(models[first], src.attr) if src.kind == "module" else None
        for other, okey in (pairs[1:] if keep is not None else ()):  # a function: no values
            attr = graphs[other].node_by_uid(inv[other][okey]).attr
            if _get(models[other], attr) is not keep:
                if not _same_values(_get(models[other], attr), keep):
                    raise GroupError(f"frozen {src.name!r} has different values in trials "
                                     f"{first} and {other}: build both from one space")
                _set(models[other], attr, keep)
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
            cells.append(Cell(name, trial, s, _emit(cell, lambda n, t=trial: (models[t], n.attr),
                                                     _device(models)),
                               needed, own_reads, exports, final,
                               any(plan.nodes[keys[n.uid]].mutates for n in nodes),
                               may_draw_random(cell)))
            cell_graphs.append(cell)
    out = shared_cell.add_node("output", Operation("output", args=[encode(
        tuple(PortRef(i) for i in range(len(frontier))))]))
    for i, k in enumerate(frontier):
        shared_cell.connect(in_cell[k], out, i)
    shared_cell.lint()

    # 6. Emit the shared cell through codegen; adopt the models' modules.
    shared_module = _emit(shared_cell, lambda n: (models[cell_attr[n.attr][0]],
                                                  cell_attr[n.attr][1]), _device(models))
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
    module = _emit(cell, lambda n: (models[first], n.attr), _device(models))
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
