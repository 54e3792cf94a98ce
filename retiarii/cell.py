"""Cell: the DARTS / NASNet search cell, written with LayerChoice and InputChoice.

A cell has ``num_predecessors`` inputs and ``num_nodes`` nodes. Node ``i`` sums
``num_ops_per_node`` operations; each operation is chosen among ``op_candidates`` and applied
to one input chosen among the cell's inputs and nodes ``0 .. i-1``. The cell returns its
nodes concatenated along the channels (or summed). With ``num_nodes=2`` and one input,
choosing node 0 as the input of node 1::

    x0 ─▶ op0_0 ─▶ node0 ─┬──────────────────▶ cat ─▶ out
                          └─▶ op1_0 ─▶ node1 ──▲

(``input0_0`` can only be ``x0``; ``input1_0`` chooses ``x0`` or ``node0``.)

It is an ordinary module made of inline choices, so it needs no mutator of its own: a
``ModelSpace`` compiles its choices like any other, and it runs eagerly as its first options
(every operation the first candidate, applied to the cell's first input).
"""
from __future__ import annotations

import copy
import functools
import operator
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .choices import InputChoice, LayerChoice


def _make(candidate: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    """A fresh module for one operation slot: a copy of a module, or a factory's product."""
    if isinstance(candidate, nn.Module):
        return copy.deepcopy(candidate)
    module = candidate()
    if not isinstance(module, nn.Module):
        raise TypeError(f"a Cell's operation candidate {candidate!r} returned {module!r}, "
                        f"not an nn.Module")
    return module


class Cell(nn.Module):
    """A search cell of ``num_nodes`` nodes; each sums operations on chosen inputs.

    Example::

        cell = rt.Cell({"conv": lambda: nn.Conv2d(16, 16, 3, padding=1),
                        "pool": lambda: nn.MaxPool2d(3, 1, 1), "skip": nn.Identity},
                       num_nodes=3, num_predecessors=2, label="normal")
        out = cell(x0, x1)        # (B, 16, H, W) twice -> (B, 3 * 16, H, W)

    The operation candidates must keep their input's shape (stride 1, same channels), since
    any of them may be applied to any earlier state. Labels: ``"{label}/op{i}_{j}"`` (the
    ``j``-th operation of node ``i``) and ``"{label}/input{i}_{j}"`` (its input: ``k <
    num_predecessors`` is the cell's input ``k``, then node ``k - num_predecessors``).
    Without ``label`` they are module paths (``"cell.ops.1.0"``, ``"cell.inputs.1.0"``);
    give two cells one label to give them one architecture.

    Args:
        op_candidates: a dict name -> candidate, or a list of candidates (named by their
            class). A candidate is a factory (a module class or function returning a fresh
            module, called once per operation) or a module (copied for each operation).
        num_nodes: nodes of the cell.
        num_ops_per_node: operations summed by each node.
        num_predecessors: inputs of the cell (``forward(*inputs)`` takes that many).
        merge: ``"concat"`` (along dim 1, as DARTS) or ``"sum"`` of the nodes' outputs.
        label: prefix of the labels of the cell's choices.
    """

    def __init__(self, op_candidates: dict[str, Any] | Sequence[Any], num_nodes: int,
                 num_ops_per_node: int = 1, num_predecessors: int = 1, merge: str = "concat",
                 label: str | None = None):
        super().__init__()
        if merge not in ("concat", "sum"):
            raise ValueError(f"Cell merge {merge!r} is not 'concat' or 'sum'")
        if min(num_nodes, num_ops_per_node, num_predecessors) < 1:
            raise ValueError("a Cell needs num_nodes, num_ops_per_node and num_predecessors "
                             "of at least 1")
        if not op_candidates:
            raise ValueError("a Cell needs at least one operation candidate")
        self.num_nodes, self.num_predecessors, self.merge = num_nodes, num_predecessors, merge
        self.ops = nn.ModuleList()
        self.inputs = nn.ModuleList()
        for i in range(num_nodes):
            ops, inputs = nn.ModuleList(), nn.ModuleList()
            for j in range(num_ops_per_node):
                where = f"{label}/op{i}_{j}" if label else None
                if isinstance(op_candidates, dict):
                    ops.append(LayerChoice({k: _make(c) for k, c in op_candidates.items()},
                                           label=where))
                else:
                    ops.append(LayerChoice([_make(c) for c in op_candidates], label=where))
                inputs.append(InputChoice(num_predecessors + i, 1, reduction="none",
                                          label=f"{label}/input{i}_{j}" if label else None))
            self.ops.append(ops)
            self.inputs.append(inputs)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) != self.num_predecessors:
            raise TypeError(f"this Cell takes {self.num_predecessors} inputs, got {len(inputs)}")
        states = list(inputs)
        for ops, choices in zip(self.ops, self.inputs):
            outs = [op(choice(states)) for op, choice in zip(ops, choices)]
            states.append(functools.reduce(operator.add, outs))
        nodes = states[self.num_predecessors:]
        if self.merge == "concat":
            return torch.cat(nodes, dim=1)  # num_nodes x (B, C, ...) -> (B, num_nodes*C, ...)
        return functools.reduce(operator.add, nodes)
