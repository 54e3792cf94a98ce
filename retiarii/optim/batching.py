"""Operator batching across models (paper §5.1, Fig. 8): one call of a frozen operator on its
models' inputs concatenated along the batch dimension.

A pure pass over a :class:`~retiarii.optim.plan.LogicalPlan`: no I/O, no engine. After the
first divergence (an adapter inserted into a frozen backbone) CSE cannot share the frozen
layers downstream: their inputs differ between models. When several models of one group hold
the same frozen operator (same origin, same frozen values, same operation: the same
``op_key``) fed different values, the operator runs once on ``cat([x_a, x_b, ...])`` and the
output is split back per model. A ``(trial, key)`` pair is batched when

* the models read the same batches (one data pipeline: they run as one group);
* the key is not shared (CSE computes it once already), its role is ``FROZEN`` or ``PURE``
  (never ``OWN``: trainable, stateful such as BatchNorm, random, or an output);
* it is a module node with one input whose module is **batch-independent**: each example's
  output depends on that example alone and on nothing but its dim-0 position
  (:func:`batch_independent`: convolutions, linears, LayerNorm, GroupNorm, embeddings,
  ``rt.FrozenBatchNorm``, element-wise activations, pooling, ``Flatten(start_dim >= 1)``,
  and ``Sequential`` of those), and not a no-op (an identity costs nothing alone and a
  concatenation batched); or an **element-wise function of two inputs** (``a + b``,
  ``a - b``, ``a * b``: a residual connection), whose operands are concatenated position by
  position (at run time, operands of different shapes, a broadcast, run per model). Other
  functions and methods are never batched (``x.view(x.size(0), -1)``, ``mean``, ``cat`` read
  the batch size or mix examples), nor custom leaves;
* it writes nothing in place, unless nothing else reads its input (as in CSE): batched, it
  writes the concatenation, and a model reading its input again would see the value unwritten;
  and no reader of its output writes in place (the output is split into views, one per model,
  and autograd forbids writing one of several views);
* at least two trials of the group hold such a pair with the same ``op_key``.

Before and after, for two models whose adapters sit at different depths of a frozen trunk::

    model A: x -> l1* -> ad_a -> l2* -> l3* -> head_a     (* frozen)
    model B: x -> l1* -> l2* -> ad_b -> l3* -> head_b
    after:   x -> l1* (CSE: once)
             l2*: once on cat([ad_a(l1), l1]) ; l3*: once on cat([l2_a, ad_b(l2_b)])

``plan.executions()`` counts a batch once: here from 12 to 9 (x, l1 once; l2 and l3 one call
each; the adapters, heads and outputs per model).

Example::

    plan = batching(cse(build_plan(models)).plan).plan
    assert batching(plan).modified is False      # idempotent
"""
from __future__ import annotations

import functools
import json
from dataclasses import replace

from typing import Any

import torch
from torch import nn

from ..frozen import FrozenBatchNorm
from ..modspec import build_module
from .plan import LogicalPlan, PassResult, Role

__all__ = ["batch_independent", "batching", "worth_measuring"]

# Modules whose output for one example depends on that example only, whatever dim 0 holds
# (the batch, or channels of an unbatched input: these act per channel too).
_PER_EXAMPLE = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.Linear, nn.LayerNorm, nn.GroupNorm, nn.Embedding, nn.Identity,
    FrozenBatchNorm,  # running statistics as constants (rt.freeze): per example
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid,
    nn.Hardtanh, nn.LeakyReLU, nn.ELU, nn.Softplus, nn.Mish, nn.PReLU,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)


def batch_independent(module: nn.Module) -> bool:
    """Whether ``module(cat([x_1, ..., x_n]))`` split along dim 0 is ``module(x_i)`` for every
    i: per-example modules (see the module docstring), never anything with buffers.

    Example::

        assert batch_independent(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()))
        assert not batch_independent(nn.BatchNorm2d(8))
    """
    if any(True for _ in module.buffers()):  # running statistics, state: never per example
        return False
    if type(module) is nn.Sequential:
        return all(batch_independent(m) for m in module)
    if type(module) in (nn.Softmax, nn.LogSoftmax):
        return module.dim is not None and module.dim != 0
    if type(module) is nn.Flatten:
        return module.start_dim >= 1
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p == 0  # p=0 returns its input; anything else draws random numbers
    return type(module) in _PER_EXAMPLE


@functools.lru_cache(maxsize=4096)
def _spec_batch_independent(spec_json: str) -> bool:
    with torch.device("meta"):
        return batch_independent(build_module(json.loads(spec_json)))


@functools.lru_cache(maxsize=4096)
def _spec_worth_it(spec_json: str) -> bool:
    """Whether batching saves anything: an identity (``nn.Identity``, ``Dropout(p=0)``) costs
    nothing alone and a concatenation batched."""
    with torch.device("meta"):
        module = build_module(json.loads(spec_json))
    noop = (nn.Identity, nn.modules.dropout._DropoutNd)
    return not all(isinstance(m, noop) or type(m) is nn.Sequential for m in module.modules())


@functools.lru_cache(maxsize=4096)
def _spec_in_place(spec_json: str) -> bool:
    """Whether the module writes a value in place anywhere (``ReLU(inplace=True)`` inside a
    ``Sequential``): batched, it would write the concatenation, not the model's own input."""
    with torch.device("meta"):
        module = build_module(json.loads(spec_json))
    return any(getattr(m, "inplace", False) is True for m in module.modules())


# Functions of two tensors computed element by element: ``a + b`` (a residual connection),
# ``a - b``, ``a * b``. Batched only when both operands are inputs (no constant operand, no
# keyword such as ``alpha``); at run time, only when each model's operands have one shape (no
# broadcasting: ``cat(a_i) + cat(b_i)`` is then ``cat(a_i + b_i)``), else one call per model.
_ELEMENTWISE = {"_operator:add", "_operator:sub", "_operator:mul",
                "torch:add", "torch:sub", "torch:mul"}


def _elementwise(op) -> bool:
    """Whether ``op`` is one of :data:`_ELEMENTWISE` applied to two graph inputs exactly."""
    return (op.kind == "function" and op.target in _ELEMENTWISE and not op.kwargs
            and len(op.args) == 2 and all(isinstance(a, dict) and set(a) == {"__in__"}
                                          for a in op.args))


def _batchable(plan: LogicalPlan, node_of: dict, trial: str, key: str) -> bool:
    node = plan.nodes[key]
    if key in plan.shared or node.role not in (Role.FROZEN, Role.PURE):
        return False
    op = node_of[trial][key].op
    if _writes(plan, node_of, trial, key) and any(plan.readers[k] != {key} for k in node.inputs):
        return False  # alone, the others would read the written value: keep it alone
    if any(_writes(plan, node_of, trial, r) for r in plan.readers[key]):
        return False  # its output is split into views, which a reader must not write
    if len(node.inputs) == 2 and _elementwise(op):
        return True
    if op.kind != "module" or len(node.inputs) != 1:
        return False
    spec = json.dumps(op.spec, sort_keys=True)
    return _spec_batch_independent(spec) and _spec_worth_it(spec)


def _writes(plan: LogicalPlan, node_of: dict, trial: str, key: str) -> bool:
    """Whether ``key`` writes a value in place (its input, or anything inside a module)."""
    node = node_of[trial].get(key)
    if node is None:  # another model's reader: judge by the plan's flag
        return plan.nodes[key].mutates
    return plan.nodes[key].mutates or (node.kind == "module" and _spec_in_place(
        json.dumps(node.op.spec, sort_keys=True)))


def batching(plan: LogicalPlan) -> PassResult:
    """Batch every frozen or weightless per-example operator that two or more models of one
    group hold with different inputs (module docstring). Run it after :func:`~.cse.cse`.

    Returns:
        ``PassResult(plan', modified)``; ``modified`` is True exactly when ``plan'.batches``
        differs from ``plan.batches``. Running it on its own result changes nothing.
    """
    taken = set(plan.batched)  # what an earlier run batched stays as it was
    node_of = {m.trial_id: {plan.keys[m.trial_id][n.uid]: n for n in m.model.graph.nodes}
               for m in plan.models}
    candidates: dict[tuple, list[tuple[str, str]]] = {}
    for key, node in plan.nodes.items():  # topological order of the keys
        for trial in node.holders:
            if (trial, key) not in taken and _batchable(plan, node_of, trial, key):
                group = (node.op_key, plan.data_roots(trial))
                candidates.setdefault(group, []).append((trial, key))
    order = {m.trial_id: i for i, m in enumerate(plan.models)}
    new = []
    for pairs in candidates.values():
        if plan.model(pairs[0][0]).data_key is None or len({t for t, _ in pairs}) < 2:
            continue  # models alone (no data key), or one model: nothing to batch with
        new.append(tuple(sorted(pairs, key=lambda p: order[p[0]])))
    if not new:
        return PassResult(plan, False)
    return PassResult(replace(plan, batches=plan.batches + tuple(new)), True)


def worth_measuring(result: PassResult, device: Any) -> bool:
    """Whether this pass's plan is worth measuring under ``batching="auto"``: it changed the
    plan and, on a CPU, batches a frozen layer with weights (one call of a weighted layer on N
    models' inputs saves per-call work; batching only weightless operations, a ReLU or a
    pooling, saves nothing on a CPU and pays the concatenations: benchmarks/README.md,
    "Operator batching"). On a GPU, where N small kernel launches cost more than one, any
    change is measured."""
    if not result.modified:
        return False
    if torch.device(device).type != "cpu":
        return True
    plan = result.plan
    return any(plan.nodes[key].role is Role.FROZEN for batch in plan.batches for _, key in batch)
