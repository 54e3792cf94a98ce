"""A built group at run time: :class:`GroupModule` runs several models as one ``nn.Module``.

:func:`~retiarii.optim.build.build_group` makes it (build.py: what the models share, how
their own nodes are cut into cells and stages); this module is what runs in every step.

``group(x, rng={trial: ctx})`` runs the shared cell once under ``torch.no_grad()`` (nothing
in it trains: autograd flows only into each model's own part), then each model's part with
that model's RNG streams swapped in (``ctx()`` is a context manager, e.g. ``TrialRun``'s), so
dropout in model A draws what it draws when A trains alone: shared nodes never draw random
numbers (the plan makes random operations a model's own). A part that writes a value in
place gets its own copy of the shared values it reads.

Between two stages each batched call (a ``Batch``, group_graph.py) runs once on its models'
inputs concatenated along dim 0 (trial order) and is split back by each model's batch size.
Its weights are frozen (``requires_grad=False``), and it runs under ``torch.no_grad()`` only
when no input needs a gradient: a model's adapter *before* a frozen layer gets its gradient
through the batched call.

Example::

    outs = group(x, rng={t: run._own_rng for t, run in runs.items()})
    sum(F.cross_entropy(outs[t], y) for t in outs).backward()
    group.state_dict_of(t)  # trial t's checkpoint, in the layout of training it alone
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch
from torch import nn

from ..graph import Graph
from .group_graph import Batch, Cell
from .plan import LogicalPlan, PlanError
from .state import StateMirror, SyncHook

__all__ = ["GroupError", "GroupModule"]


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
