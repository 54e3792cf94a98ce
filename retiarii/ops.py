"""Small merge modules that mutators connect paths into.

They take any number of inputs (``connect`` appends to them) and have no weights. Exported
source writes them as plain torch expressions (``export_expr``), so a model exported from a
space that used them still needs only torch.

Example::

    merge = self.create_node("merge", retiarii.ops.Sum())
    self.connect(path_a, merge); self.connect(path_b, merge)
"""
from __future__ import annotations

import torch
from torch import nn

from .modspec import leaf


def _add_all(xs: tuple) -> torch.Tensor:
    """x0 + x1 + ..., left to right (the order an exported ``a + b + c`` computes)."""
    out = xs[0]
    for x in xs[1:]:
        out = out + x
    return out


@leaf
class Sum(nn.Module):
    """``x0 + x1 + ...`` (inputs of equal shape)."""

    variadic = True

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return _add_all(xs)

    @staticmethod
    def export_expr(args: list[str], kwargs: dict) -> str:
        return " + ".join(args) if len(args) > 1 else args[0]


@leaf
class Mean(nn.Module):
    """The element-wise mean of the inputs."""

    variadic = True

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return _add_all(xs) / len(xs)

    @staticmethod
    def export_expr(args: list[str], kwargs: dict) -> str:
        return f"({' + '.join(args)}) / {len(args)}"


@leaf
class Concat(nn.Module):
    """``torch.cat(inputs, dim)``: (B, C_i, ...) -> (B, sum C_i, ...) for dim=1."""

    variadic = True

    def __init__(self, dim: int = 1):
        super().__init__()
        self.dim = dim

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return torch.cat(xs, dim=self.dim)

    @staticmethod
    def export_expr(args: list[str], kwargs: dict) -> str:
        return f"torch.cat([{', '.join(args)}], dim={kwargs.get('dim', 1)})"


@leaf
class Zero(nn.Module):
    """The "no connection" operation of DARTS-style cells: zeros shaped like the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.0

    @staticmethod
    def export_expr(args: list[str], kwargs: dict) -> str:
        return f"{args[0]} * 0.0"
