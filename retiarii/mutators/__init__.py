"""Built-in mutators, one per file.

* :class:`InputMutator` chooses the input(s) of matched nodes among earlier nodes (skip
  connections).
* :class:`OperatorMutator` replaces matched ops by a chosen candidate.
* :class:`InsertingMutator` inserts a chosen op (or nothing) after matched nodes.
* :class:`AddNodeMutator`, :class:`AddEdgeMutator`, :class:`ChangeActivationMutator` grow a
  graph step by step, open-ended with ``steps=None`` (Weight Agnostic Networks, Large-Scale
  Evolution).

Example::

    space = rt.ModelSpace(Net(), [
        rt.apply_mutator("layer2.*.conv*", rt.mutators.OperatorMutator([conv3x3, max_pool])),
        rt.apply_mutator("fc", rt.mutators.InputMutator(["layer1.*.relu"]))],
        example_input=torch.randn(1, 3, 32, 32))

See docs/spaces.md for a guide to writing mutators and spaces.
"""
from .evolving import AddEdgeMutator, AddNodeMutator, ChangeActivationMutator
from .input import InputMutator
from .inserting import InsertingMutator
from .operator import OperatorMutator

__all__ = ["AddEdgeMutator", "AddNodeMutator", "ChangeActivationMutator", "InputMutator",
           "InsertingMutator", "OperatorMutator"]
