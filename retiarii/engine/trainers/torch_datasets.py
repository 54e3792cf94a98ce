"""A :class:`~.trainer.ClassifierTrainer`'s ``dataset=`` given as a torch ``Dataset``: checked
when the trainer is made (a ``DataLoader``, an iterable-only data set or another type is refused
naming the fix), then read once per process into an ``(X, y)`` pair of tensors, so that it
trains exactly as those tensors given directly (the same batches, the same data key)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...choices import ValueChoice

__all__ = ["check_dataset", "read_dataset"]


def check_dataset(owner: str, dataset: Any) -> None:
    """Refuse, when the trainer is made, a ``dataset`` no trial could read, naming the fix."""
    if isinstance(dataset, (str, tuple, list, ValueChoice)) or (
            isinstance(dataset, torch.utils.data.Dataset)
            and not isinstance(dataset, torch.utils.data.IterableDataset)):
        return
    if isinstance(dataset, torch.utils.data.DataLoader):
        raise TypeError(
            f"{owner}(dataset=...) got a DataLoader: the trainer makes its own batches (each "
            f"epoch's order a function of the seed, so a killed trial resumes at its batch); "
            f"give it the loader's data set, {owner}(dataset=loader.dataset, "
            f"batch_size={dataset.batch_size}), or write your own loop as a FunctionTrainer "
            f"(docs/function_trainer.md)")
    if isinstance(dataset, torch.utils.data.IterableDataset) or (
            hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"{owner}(dataset=...) got {type(dataset).__name__}, which can only be iterated: "
            f"the trainer needs a name ('digits'), an (X, y) pair of tensors, or a map-style "
            f"torch Dataset (__len__ and __getitem__) of (input, label) items; for a stream, "
            f"write your own loop as a FunctionTrainer (docs/function_trainer.md)")
    raise TypeError(
        f"{owner}(dataset=...) got {type(dataset).__name__}: give a name ('digits'), an (X, y) "
        f"pair of tensors, or a map-style torch Dataset of (input, label) items")


def read_dataset(dataset: torch.utils.data.Dataset, owner: str = "ClassifierTrainer"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A map-style Dataset's items, ``(input, label)`` each, read in index order into an
    ``(X, y)`` pair: inputs stacked (every input a tensor or array of one shape), labels as
    int64. It is read once per trainer object and process, and must fit in memory (a folder
    of images: :class:`~.image_trainer.ImageFolderTrainer` decodes them batch by batch).

    Raises:
        ValueError: an item is not an (input, label) pair, the inputs are not tensors of one
            shape, or a label is not an integer class; the message names the item and the fix.
    """
    n = len(dataset)
    if n == 0:
        raise ValueError(f"{owner}(dataset=...): the {type(dataset).__name__} is empty")
    if isinstance(dataset, torch.utils.data.TensorDataset) and len(dataset.tensors) == 2:
        x, y = dataset.tensors
        if y.dim() == 1 and not y.is_floating_point():
            return x, y.to(torch.int64)  # its items are these rows: no loop
    inputs, labels = [], []
    for i in range(n):
        item = dataset[i]
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(
                f"{owner}(dataset=...): item {i} of the {type(dataset).__name__} is "
                f"{type(item).__name__}, not an (input, label) pair; return (x, y) from "
                f"__getitem__, or train on other items with a Trainer subclass or a "
                f"FunctionTrainer (docs/function_trainer.md)")
        x, y = item
        if not isinstance(x, (torch.Tensor, np.ndarray)):
            raise ValueError(
                f"{owner}(dataset=...): item {i}'s input is {type(x).__name__}, not a tensor; "
                f"give the Dataset a transform to tensors (torchvision's ToTensor() for "
                f"images), or use ImageFolderTrainer for a folder of images")
        inputs.append(torch.as_tensor(x))
        labels.append(y)
    shapes = {tuple(x.shape) for x in inputs}
    if len(shapes) > 1:
        raise ValueError(f"{owner}(dataset=...): the {type(dataset).__name__}'s inputs have "
                         f"several shapes ({sorted(shapes)[:3]}...): resize or pad them to one "
                         f"in the Dataset, so that a batch stacks")
    for i, label in enumerate(labels):  # an int, a NumPy integer or a one-element int tensor
        whole = isinstance(label, (int, np.integer)) or (
            isinstance(label, torch.Tensor) and label.numel() == 1
            and not label.is_floating_point())
        if isinstance(label, bool) or not whole:
            raise ValueError(f"{owner}(dataset=...): item {i}'s label is {label!r}, not an "
                             f"integer class; ClassifierTrainer's cross-entropy needs class "
                             f"indices 0..C-1")
    return torch.stack(inputs), torch.tensor([int(v) for v in labels], dtype=torch.int64)
