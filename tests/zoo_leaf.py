"""User leaf modules for the zoo, in their own file so an exported model can import them.

An exported model imports its leaf classes from where they were defined, so this file must be
importable where the export runs, which may be a machine without retiarii. The decorator import
is therefore guarded: without retiarii, ``leaf`` is the identity and the classes work unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

try:
    from retiarii import leaf
except ImportError:  # an exported model running without retiarii
    def leaf(cls):
        return cls


@leaf
class GatedConv(nn.Module):
    """A conv whose output is gated by a data-dependent branch: fx cannot trace through it.

    Example::

        >>> GatedConv(8, kernel_size=3)(torch.randn(1, 8, 6, 6)).shape
        torch.Size([1, 8, 6, 6])

    Args:
        channels: input and output channels.
        kernel_size: odd kernel size; padding keeps the spatial size.
        mode: "tanh" or "sigmoid" gate.
    """

    def __init__(self, channels: int, kernel_size: int = 3, mode: str = "tanh"):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size, padding=kernel_size // 2)
        self.mode = mode

    def forward(self, x):
        y = self.conv(x)
        if y.mean() > 0:  # data-dependent: needs a concrete value, so this must be a leaf
            return y * (torch.tanh(y) if self.mode == "tanh" else torch.sigmoid(y))
        return y


class Scaler(nn.Module):
    """Not decorated: passed to ``trace(leaf_modules=[Scaler])``; its constructor arguments are
    read back from attributes of the same name (``features``, ``init``).

    Example::

        >>> Scaler(4, init=0.5)(torch.ones(2, 4))[0, 0].item()
        0.5

    Args:
        features: size of the last dimension.
        init: initial value of the per-feature scale.
    """

    def __init__(self, features: int, init: float = 1.0):
        super().__init__()
        self.features = features
        self.init = init
        self.scale = nn.Parameter(torch.full((features,), float(init)))

    def forward(self, x):
        for _ in range(int(x.shape[0] > 1) + 1):  # Python loop on a shape: fine in a leaf
            x = x * self.scale
        return x

    def extra_repr(self) -> str:
        return f"features={self.features}, init={self.init}"


@leaf
class Activation(nn.Module):
    """Applies a callable given to the constructor. A module-level function (``torch.tanh``)
    can be recorded; a lambda cannot, and trace must say so.

    Example::

        >>> Activation(torch.tanh)(torch.zeros(2)).tolist()
        [0.0, 0.0]

    Args:
        fn: the function applied to the input.
    """

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)
