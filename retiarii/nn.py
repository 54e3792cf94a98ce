"""``torch.nn`` layers that take :class:`~retiarii.ValueChoice` constructor arguments.

Every layer of ``torch.nn`` is available under the same name; it behaves exactly as the torch
layer (built with each ValueChoice's first value) and records the choices, which a
:class:`~retiarii.ModelSpace` turns into a mutator. Models emitted from the space use the plain
torch class.

Example::

    import retiarii as rt
    width = rt.ValueChoice([16, 32, 64], label="width")
    conv = rt.nn.Conv2d(3, width, kernel_size=rt.ValueChoice([3, 5]), padding="same")
    bn = rt.nn.BatchNorm2d(width)                  # the same object: tied to the conv
"""
from __future__ import annotations

import torch.nn as _torch_nn

from .cell import Cell
from .choices import InputChoice, LayerChoice, Repeat, ValueChoice, wrap_layer

__all__ = ["Cell", "InputChoice", "LayerChoice", "Repeat", "ValueChoice"]


def __getattr__(name: str):
    layer = getattr(_torch_nn, name, None)
    if isinstance(layer, type) and issubclass(layer, _torch_nn.Module):
        return wrap_layer(layer)
    raise AttributeError(f"retiarii.nn has no layer {name!r} (torch.nn has none either)")
