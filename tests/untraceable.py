"""Modules torch.fx cannot trace (not marked @retiarii.leaf), importable by worker processes
and by exported models: the user's own code, as a mutator would receive it."""
from torch import nn


class LoopMerge(nn.Module):
    """The paper's Inception merge written naively: loops over its arguments and skips the
    empty ones, a branch on a tensor's value."""

    def forward(self, *xs):
        out = xs[0]
        for x in xs[1:]:
            if x.abs().sum() > 0:
                out = out + x
        return out


class Gate(nn.Module):
    """A layer with a constructor argument held in an attribute of the same name and a
    data-dependent branch."""

    def __init__(self, channels: int, scale: float = 2.0):
        super().__init__()
        self.channels, self.scale = channels, scale
        self.conv = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        if x.mean() > 0:
            return self.conv(x) * self.scale
        return self.conv(x)


class Hidden(nn.Module):
    """Untraceable, and its constructor argument is kept under another name: it cannot be
    re-created from its attributes."""

    def __init__(self, channels: int):
        super().__init__()
        self.c = channels

    def forward(self, x):
        return x if x.sum() > 0 else -x
