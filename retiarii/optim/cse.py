"""Common sub-expression elimination across models (paper §5.1): compute a node once for
every model that holds it.

A pure pass over a :class:`~retiarii.optim.plan.LogicalPlan`: no I/O, no engine. A key held
by two or more models is shared when

* its holders read the same batches (one data pipeline: they will run as one group);
* it is not the model's own (:class:`~retiarii.optim.plan.Role` ``OWN``: trainable, stateful,
  random, or an output): the data pipeline, constants, frozen nodes, weightless
  deterministic operations;
* every input is shared too (same inputs: a frozen layer fed by a model's trainable layer
  differs between models after the first step);
* it does not write its input in place, unless that input is a frozen layer's fresh output
  that nothing else reads (``conv -> relu(inplace=True)``): a shared value is read by several
  models and must not change under them.

Before and after, for two models whose frozen backbone feeds different heads::

    model A: x -> conv(frozen) -> relu -> fc_a      model B: x -> conv(frozen) -> relu -> fc_b
    after:   x -> conv -> relu  (once, no_grad)  -> fc_a (A's own)
                                                  -> fc_b (B's own)

``plan.executions()`` drops from 8 to 5 (x, conv, relu once; fc and output per model).

Example::

    result = cse(plan)
    assert cse(result.plan).modified is False    # idempotent
"""
from __future__ import annotations

from dataclasses import replace

from .plan import LogicalPlan, PassResult, Role

__all__ = ["cse"]


def _shareable(plan: LogicalPlan, key: str, shared: set[str], roots: dict) -> bool:
    node = plan.nodes[key]
    if node.role is Role.OWN or len(node.holders) < 2:
        return False
    if len({roots[t] for t in node.holders}) > 1:  # models fed other batches: other groups
        return False
    if not all(src in shared for src in node.inputs):
        return False
    if any((t, key) in plan.batched for t in node.holders):  # batching.py ran first: keep it
        return False
    if node.mutates:  # only on a fresh value that no one else reads (see the module docstring)
        src = node.inputs[0] if node.inputs else None
        return src is not None and plan.nodes[src].role is Role.FROZEN \
            and plan.readers[src] == {key}
    return True


def cse(plan: LogicalPlan) -> PassResult:
    """Share every key that can be computed once for all its holders (module docstring).

    Returns:
        ``PassResult(plan', modified)``; ``modified`` is True exactly when ``plan'.shared``
        differs from ``plan.shared``. Running it on its own result changes nothing.
    """
    shared = set(plan.shared)  # what earlier passes shared stays shared
    roots = {m.trial_id: plan.data_roots(m.trial_id) for m in plan.models}
    for key in plan.nodes:  # a topological order: inputs are decided before their readers
        if key not in shared and _shareable(plan, key, shared, roots):
            shared.add(key)
    new = frozenset(shared)
    if new == plan.shared:
        return PassResult(plan, False)
    return PassResult(replace(plan, shared=new), True)
