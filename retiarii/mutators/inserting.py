"""InsertingMutator: insert a chosen op (or nothing) after each matched node.

The new node takes the matched node's output and feeds every former user in its place::

    before (targets "conv1", candidates [None, nn.BatchNorm2d(8)])

        x ─▶ conv1 ─▶ relu ─▶ ...

    after, choosing BatchNorm2d                      after, choosing None

        x ─▶ conv1 ─▶ conv1_inserted ─▶ relu ─▶ ...      x ─▶ conv1 ─▶ relu ─▶ ... (unchanged)

Changing widths: an inserted op with its own width (``nn.Conv2d(8, 16, 1)``) breaks the layer
after it. Write the downstream layer as a lazy module (``nn.LazyConv2d``, ``nn.LazyLinear``,
``nn.LazyBatchNorm2d``) in the base model, or insert lazy modules
(``nn.LazyConv2d(16, 1)``) so the inserted op adapts to what it receives;
``space.instantiate`` settles their sizes from the example input.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..mutator import Mutator
from ._common import flat_targets, operation_of


class InsertingMutator(Mutator):
    """After every matched node, insert an op chosen among candidates; ``None`` inserts nothing.

    Example::

        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        >>> mutator = InsertingMutator([None, nn.BatchNorm2d(8), nn.LazyConv2d(8, 1)])
        >>> space = rt.ModelSpace(net, [rt.apply_mutator("0", mutator)],
        ...                       example_input=torch.randn(1, 3, 8, 8))
        >>> [m.sample["insertingmutator0/0"] for m in space.enumerate()]
        [None, 'BatchNorm2d', 'LazyConv2d']
        >>> model = space.instantiate({"insertingmutator0/0": "BatchNorm2d"})
        >>> [n.name for n in model.graph.nodes]
        ['input', '0', '0_inserted', '1', 'output']

    Args:
        candidates: ``None`` and/or ``nn.Module`` instances, functions,
            ``functools.partial(fn, **kwargs)`` or one-input Graphs; or a dict of name ->
            candidate. One choice per target, labelled ``"{label}/{target name}"``.
        name: suffix of the inserted node's name (``"{target name}_{name}"``).
        shared: one choice (labelled with the mutator's label) for every target.
        label: the mutator's label (default: class name and position in the space).
    """

    def __init__(self, candidates: Sequence[Any] | dict[str, Any], name: str = "inserted",
                 shared: bool = False, label: str | None = None):
        super().__init__(label)
        self.candidates, self.name, self.shared = candidates, name, shared

    def mutate(self, targets):
        for node in flat_targets(targets):
            label = self._name if self.shared else f"{self._name}/{node.name}"
            op = self.choose(self.candidates, label=label)
            if op is None:
                continue
            order = {n.uid: i for i, n in enumerate(self.graph.nodes)}
            users = sorted(self.graph.out_edges(node), key=lambda e: (order[e[0].uid], e[1]))
            new = self.create_node(f"{node.name}_{self.name}", operation_of(self, op))
            self.connect(node, new)
            for dst, port in users:
                self.connect(new, dst, port)
