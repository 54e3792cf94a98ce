"""InputMutator: choose which earlier node(s) feed each target (skip connections).

For every matched node, one choice picks the predecessor of one input port among candidate
nodes. The node feeding the port in the base model is always the first candidate, so the
default sample is the base model. With ``n_chosen > 1`` a merge node (sum, mean or concat)
combines the chosen nodes. Candidates that the target already reaches are left out, so the
graph stays acyclic::

    before (target "conv3", candidates ["conv1"])          after, choosing "conv1"

        x ─▶ conv1 ─▶ conv2 ─▶ conv3 ─▶ out                   x ─▶ conv1 ─▶ conv2   (unused)
                                                                     └──────▶ conv3 ─▶ out

    with n_chosen=2, reduction="sum", choosing "conv2,conv1":

        x ─▶ conv1 ─▶ conv2 ─▶ conv3_inputs ─▶ conv3 ─▶ out     (conv3_inputs = Sum)
               └──────────────────▲
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

from .. import ops
from ..graph import Node
from ..mutator import MutationError, Mutator
from ._common import COMPUTING, flat_targets, relative_name, select_nodes, shapes_of

SAME_SHAPE = "same_shape"
_MERGES = {"sum": ops.Sum, "mean": ops.Mean, "concat": ops.Concat}


class InputMutator(Mutator):
    """Choose the input(s) of each matched node among candidate predecessors.

    Example::

        >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))
        >>> space = rt.ModelSpace(net, [rt.apply_mutator("3", InputMutator(["input", "0"]))])
        >>> [m.sample for m in space.enumerate()]    # "3" is fed by "2", "input" or "0"
        [{'inputmutator0/3': '2'}, {'inputmutator0/3': 'input'}, {'inputmutator0/3': '0'}]

    Keys are node names relative to the module holding the target (``"b0"`` for the target
    ``"cells.1.b2_a"`` and the candidate ``"cells.1.b0"``), so with ``shared=True`` one choice
    ties the same position in every repeated cell. A former input that no longer feeds
    anything stays in the graph, unused.

    Args:
        candidates: ``"same_shape"`` (every node before the target in graph order whose
            output has the shape of the port's current input; needs the space's
            ``example_input``), a name, glob or module class or a list of them, or a
            callable ``target -> list of nodes or names``.
        n_chosen: how many candidates feed the port; more than one are merged.
        reduction: ``"sum"``, ``"mean"`` or ``"concat"`` (along dim 1): how ``n_chosen > 1``
            inputs are merged.
        port: which input port of the target is chosen.
        shared: one choice (labelled with the mutator's label) for every target, instead of
            one per target labelled ``"{label}/{target name}"``.
        label: the mutator's label (default: class name and position in the space).
    """

    def __init__(self, candidates: str | Sequence | Callable[[Node], Any] = SAME_SHAPE,
                 n_chosen: int = 1, reduction: str = "sum", port: int = 0,
                 shared: bool = False, label: str | None = None):
        super().__init__(label)
        if reduction not in _MERGES:
            raise ValueError(f"reduction {reduction!r} is not one of {sorted(_MERGES)}")
        if n_chosen < 1:
            raise ValueError(f"n_chosen={n_chosen} must be at least 1")
        self.candidates, self.n_chosen, self.reduction = candidates, n_chosen, reduction
        self.port, self.shared = port, shared

    def mutate(self, targets):
        for target in flat_targets(targets):
            self._choose_inputs(target)

    def _pool(self, target: Node) -> list[Node]:
        """The port's current feeder first, then the other candidates in graph order."""
        where = f"{self._name}: target {target.name!r}"
        inputs = target.inputs
        if self.port >= len(inputs):
            raise MutationError(f"{where} has {len(inputs)} input ports; port {self.port} "
                                f"does not exist")
        current = inputs[self.port]
        # feeding the target from these is a cycle
        blocked = {target.uid} | self.graph.descendant_uids(target)
        if self.candidates == SAME_SHAPE:
            shapes = shapes_of(self, "candidates='same_shape'", required=True)
            want = shapes.get(current.uid)
            earlier = []
            for n in self.graph.nodes:
                if n.uid == target.uid:
                    break
                earlier.append(n)
            found = [n for n in earlier if n.kind in COMPUTING + ("input",)
                     and want is not None and shapes.get(n.uid) == want]
        else:
            try:
                found = select_nodes(self.graph, self.candidates, target)
            except KeyError as e:
                raise MutationError(f"{where}: candidate {e.args[0]!r} is not a node of the "
                                    f"graph") from None
        found = [n for n in found if n.uid not in blocked and n.kind != "output"]
        return [current] + [n for n in found if n.uid != current.uid]

    def _choose_inputs(self, target: Node) -> None:
        pool = self._pool(target)
        label = self._name if self.shared else f"{self._name}/{target.name}"
        names = {n.uid: relative_name(n, target) for n in pool}
        if len(set(names.values())) < len(pool):  # two scopes hold the same short name
            names = {n.uid: n.name for n in pool}
        if self.n_chosen == 1:
            chosen = self.choose({names[n.uid]: n for n in pool}, label=label)
            if chosen is not pool[0]:  # the base input kept: the target stays untouched
                self.connect(chosen, target, self.port)
            return
        options = {",".join(names[n.uid] for n in combo): combo
                   for combo in itertools.combinations(pool, self.n_chosen)}
        chosen = self.choose(options, label=label)
        merge = self.create_node(f"{target.name}_inputs", _MERGES[self.reduction]())
        for node in chosen:
            self.connect(node, merge)
        self.connect(merge, target, self.port)
