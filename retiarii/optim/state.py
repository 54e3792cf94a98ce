"""Frozen layers with state: key them by their running statistics, and keep every copy equal.

A frozen BatchNorm (parameters with ``requires_grad=False``, running statistics updated in
train mode: :func:`retiarii.modspec.is_frozen`) computes what it computes from its inputs
*and* its running statistics, and updates those from its inputs alone. So two models whose
copies hold equal statistics and read equal inputs compute equal outputs and make equal
updates: the layer is shared exactly when its copies start equal. Its plan node is
``stateful`` and its key holds a digest of its state (``PlanModel.state``); the driver,
which does not hold the values, plans with an unknown state (equal everywhere), and the
worker re-keys the plan with the values it holds at the segment start
(:func:`with_states`): copies that differ get different keys, so CSE shares them only
among models whose copies are equal, and everything after such a layer splits with it.

Before and after, for three models whose frozen trunk holds a BatchNorm, ``c`` resumed from
another step (its statistics differ)::

    plan (driver):  x -> conv* -> bn*[?] -> relu    shared by a, b, c
    with_states:    x -> conv*                      shared by a, b, c
                    bn*[s1] -> relu                 shared by a, b
                    bn*[s2] -> relu                 c's own (alone in its key)

The group then runs the shared BatchNorm once, in the first holder's module, and copies its
buffers into the other holders' modules after each run (:class:`StateMirror`): each model's
``state_dict`` and checkpoint hold exactly what training it alone gives.

Example::

    plan = with_states(plan, state_digests(plan, models)).plan
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from .plan import LogicalPlan, PassResult, PlanError, build_plan

__all__ = ["StateMirror", "SyncHook", "check_untied", "state_digest", "state_digests", "with_states"]


def state_digest(module: nn.Module) -> str:
    """A hash of ``module``'s persistent buffers (names, dtypes, shapes and bytes)."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if isinstance(tensor, nn.Parameter):
            continue  # frozen values: equal by construction (checked when grouped)
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def state_digests(plan: LogicalPlan, models: Mapping[str, nn.Module]) -> dict[str, dict[int, str]]:
    """trial -> node uid -> :func:`state_digest` of its module in ``models[trial]``, for
    every stateful node of the plan (none: an empty mapping per trial)."""
    out: dict[str, dict[int, str]] = {}
    for pm in plan.models:
        graph, mine = pm.model.graph, {}
        for uid, key in plan.keys[pm.trial_id].items():
            if plan.nodes[key].stateful:
                mine[uid] = state_digest(models[pm.trial_id].get_submodule(
                    graph.node_by_uid(uid).attr))
        out[pm.trial_id] = mine
    return out


def with_states(plan: LogicalPlan, digests: Mapping[str, Mapping[int, str]]) -> PassResult:
    """The plan with its models' stateful nodes keyed by ``digests`` (see the module
    docstring). A key stays shared when every holder's node was shared before and all its
    inputs stay shared; batched pairs keep their batches under their new keys.

    Returns:
        ``PassResult(plan', modified)``; ``modified``: some key changed.
    """
    if not any(d for d in digests.values()):
        return PassResult(plan, False)
    models = [replace(m, state={**m.state, **digests.get(m.trial_id, {})}) for m in plan.models]
    new = build_plan(models)
    if {t: dict(k) for t, k in new.keys.items()} == {t: dict(k) for t, k in plan.keys.items()}:
        return PassResult(plan, False)
    old_of = {(t, new.keys[t][uid]): key for t, keys in plan.keys.items()
              for uid, key in keys.items()}  # (trial, new key) -> its old key
    shared: set[str] = set()
    for key, node in new.nodes.items():  # topological: inputs are decided first
        if len(node.holders) > 1 and all(old_of[(t, key)] in plan.shared for t in node.holders) \
                and all(src in shared for src in node.inputs):
            shared.add(key)
    renamed = {(t, old): key for (t, key), old in old_of.items()}
    batches = tuple(tuple((t, renamed[(t, k)]) for t, k in batch) for batch in plan.batches)
    return PassResult(replace(new, shared=frozenset(shared), batches=batches), True)


@dataclass
class StateMirror:
    """A shared stateful module (the one the group runs) and the other holders' copies,
    which :meth:`sync` makes equal to it after each run."""

    source: nn.Module
    copies: Sequence[nn.Module]

    def sync(self) -> None:
        """Copy the source's persistent buffers into every copy (in place: the copies'
        tensors stay the ones their models and optimizers hold)."""
        src = [b for b in self.source.state_dict(keep_vars=True).values()
               if not isinstance(b, nn.Parameter)]
        dst: list[torch.Tensor] = []
        for copy in self.copies:
            dst.extend(b for b in copy.state_dict(keep_vars=True).values()
                       if not isinstance(b, nn.Parameter))
        with torch.no_grad():
            torch._foreach_copy_(dst, src * len(self.copies))


class SyncHook:
    """A forward hook of a group's shared cell: after every call (whoever makes it: the
    group's forward, a measurement timing the cell alone) each :class:`StateMirror` syncs."""

    def __init__(self, mirrors: list[StateMirror]):
        self.mirrors = mirrors

    def __call__(self, module: nn.Module, args: object, output: object) -> None:
        for mirror in self.mirrors:
            mirror.sync()


def check_untied(plan: LogicalPlan, models: Mapping[str, nn.Module], key: str) -> None:
    """Refuse a shared stateful module that a holder also calls at a place it does not share
    (one BatchNorm object at two places): its statistics would move twice per step in that
    model's copy and once in the others'.

    Raises:
        PlanError: naming the trial, the node and the fix.
    """
    for trial in plan.nodes[key].holders:
        keys, graph = plan.keys[trial], plan.model(trial).model.graph
        uid = next(u for u, k in keys.items() if k == key)
        mine = models[trial].get_submodule(graph.node_by_uid(uid).attr)
        for node in graph.nodes:
            if node.kind == "module" and node.uid != uid and keys[node.uid] not in plan.shared \
                    and models[trial].get_submodule(node.attr) is mine:
                raise PlanError(f"trial {trial}: the frozen {node.name!r} with running "
                                f"statistics is one module at a shared place and at its own: "
                                f"untie it (a copy per place) to group it")
