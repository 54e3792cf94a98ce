"""``rt.fixed_arch``: one architecture of a space as a plain ``nn.Module``, to retrain a
selected architecture from scratch or load the weights ``retiarii export`` wrote."""
from __future__ import annotations

import json
import os
from typing import Any

from torch import nn

from .sampler import SampleError

__all__ = ["fixed_arch"]


def _read_sample(sample: Any) -> dict:
    """A sample given as a dict, or a JSON file: the ``.json`` that ``retiarii export`` writes
    (its ``"sample"``) or a plain ``label -> key`` object."""
    if isinstance(sample, (str, os.PathLike)):
        with open(sample) as f:
            data = json.load(f)
        if isinstance(data, dict) and isinstance(data.get("sample"), dict):
            data = data["sample"]
        sample = data
    if not isinstance(sample, dict):
        raise SampleError(f"fixed_arch: a sample is a dict of label -> chosen key (or the .json "
                          f"that `retiarii export` writes), not {sample!r}")
    return dict(sample)


def fixed_arch(space: Any, sample: Any, *, trainer: Any = None, weights: Any = None) -> nn.Module:
    """The architecture ``sample`` of ``space`` as a plain ``nn.Module`` (torch only, no choice
    left), with fresh weights unless ``weights`` are given.

    Example:
        >>> import torch, retiarii as rt
        >>> from torch import nn
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = rt.nn.Linear(4, rt.ValueChoice([8, 16], label="width"))
        ...     def forward(self, x):
        ...         return self.fc(x)
        >>> space = rt.ModelSpace(Net(), example_input=torch.zeros(1, 4))
        >>> net = rt.fixed_arch(space, {"width": 16})
        >>> net(torch.zeros(2, 4)).shape
        torch.Size([2, 16])

    Args:
        space: a :class:`~retiarii.ModelSpace`.
        sample: label -> chosen key (a stored model's ``sample``), or the path of a JSON file
            holding one (the ``.json`` of ``retiarii export``).
        trainer: the search's trainer: the labels of its ``ValueChoice`` settings (a sampled
            learning rate) are set aside, since they choose no part of the module.
        weights: a state dict, or the path of the ``.pt`` that ``retiarii export`` wrote
            (trained or inherited weights), loaded strictly.

    Raises:
        SampleError: a label the space never asks for (a typo, a sample of another space), or
            a choice the sample leaves undecided.
    """
    import torch

    sample = _read_sample(sample)
    if trainer is not None:
        labels = {v.label or k for k, v in trainer.value_choices().items()}
        sample = {k: v for k, v in sample.items() if k not in labels}
    try:
        module = space.build(sample)
    except SampleError as err:
        hint = "" if trainer is not None else (
            " (labels of the trainer's hyper-parameters: pass trainer=... to set them aside)")
        raise SampleError(f"fixed_arch: {err}{hint}") from None
    if weights is not None:
        if isinstance(weights, (str, os.PathLike)):
            weights = torch.load(weights, map_location="cpu", weights_only=True)
        module.load_state_dict(weights)
    return module
