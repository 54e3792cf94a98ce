"""OperatorMutator: replace each matched node's operation by one chosen among candidates.

The node keeps its name, uid, inputs and users; only what it computes changes::

    before (targets "conv*")                     after, choosing max_pool for "conv2"

        x ─▶ conv1 ─▶ relu ─▶ conv2 ─▶ fc            x ─▶ conv1 ─▶ relu ─▶ conv2 ─▶ fc
             Conv2d           Conv2d                      Conv2d           MaxPool2d

Changing widths: a candidate that changes the number of channels breaks the layer after it,
which was built for the old width (``space.instantiate`` raises ``ShapeMismatchError``
naming that layer). Write the layers downstream of a width choice as lazy modules
(``nn.LazyConv2d(out, 3)``, ``nn.LazyLinear(out)``, ``nn.LazyBatchNorm2d()``): their input
sizes are left open in the graph and settled by ``space.instantiate``, which runs the
space's example input and writes the concrete modules back into the model's graph.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..mutator import Mutator
from ._common import flat_targets, operation_of, same_op


class OperatorMutator(Mutator):
    """Replace the operation of every matched node by a chosen candidate.

    Example::

        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
        ...                     nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        >>> mutator = OperatorMutator([nn.Conv2d(8, 8, 5, padding=2), nn.MaxPool2d(3, 1, 1),
        ...                            torch.relu])
        >>> space = rt.ModelSpace(net, [rt.apply_mutator("2", mutator)],
        ...                       example_input=torch.randn(1, 3, 8, 8))
        >>> space.size()
        3
        >>> [m.sample["operatormutator0/2"] for m in space.enumerate()]
        ['Conv2d', 'MaxPool2d', 'torch.relu']
        >>> space.instantiate({"operatormutator0/2": "MaxPool2d"}).graph["2"]
        Node('2', MaxPool2d, uid=3)

    A candidate equal to the node's current operation leaves the node untouched (so models
    that keep it share it, see ``Model.shared_nodes``). Modules are copied into each model;
    a composite module (not a ``torch.nn`` layer, not marked ``@retiarii.leaf``) becomes a
    cell (a subgraph node), or one opaque module node if torch.fx cannot trace it; a
    :class:`~retiarii.Graph` is used as a cell directly.

    Args:
        candidates: a list of ``nn.Module`` instances, functions (``torch.relu``),
            ``functools.partial(fn, **kwargs)`` or Graphs; or a dict of name -> candidate
            (the names become the keys in samples).
        shared: one choice (labelled with the mutator's label) for every target, instead of
            one per target labelled ``"{label}/{target name}"``.
        label: the mutator's label (default: class name and position in the space).
    """

    def __init__(self, candidates: Sequence[Any] | dict[str, Any], shared: bool = False,
                 label: str | None = None):
        super().__init__(label)
        self.candidates, self.shared = candidates, shared

    def mutate(self, targets):
        for node in flat_targets(targets):
            label = self._name if self.shared else f"{self._name}/{node.name}"
            op = operation_of(self, self.choose(self.candidates, label=label))
            if not same_op(node, op):
                self.replace(node, op)
