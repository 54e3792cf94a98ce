"""A classifier trainer whose training split is cut in two: weights on one part, architecture
steps on the other, the validation split left for the reported result (DARTS' recipe).

DARTS (Liu et al., 2019, section 3.1) searches on half of CIFAR-10's training set for the
weights and the other half for the architecture parameters, and reports the derived cell's
accuracy elsewhere. :class:`ArchSplitTrainer` does that on any data set of
:class:`~retiarii.engine.trainers.trainer.ClassifierTrainer`: its ``train_dataloader`` yields the
weight part, its ``arch_dataloader`` the architecture part (the differentiable strategies
take their architecture batches from it: :meth:`SegmentContext.arch_batches`), and its
``val_dataloader`` the same held-out split as ``ClassifierTrainer`` (what a search reports)::

    all examples ── split_seed ──> validation (val_fraction)        reported
                                  training ── arch_seed ──> weights (1 - arch_fraction)
                                                            architecture (arch_fraction)

Example::

    trainer = ArchSplitTrainer(dataset="digits", epochs=4, arch_fraction=0.5)
    weights, arch, val = trainer.split_indices({})     # disjoint index sets
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from .engine.trainers.trainer import ClassifierConfig, ClassifierTrainer
from .refs import ref_of

__all__ = ["ArchSplitConfig", "ArchSplitTrainer"]


@dataclasses.dataclass
class ArchSplitConfig(ClassifierConfig):
    """:class:`ClassifierConfig` plus the cut of the training split."""

    arch_fraction: float = 0.5  # DARTS: half of the training data for the architecture steps
    arch_seed: int = 0  # fixes which training examples go to the architecture part


class ArchSplitTrainer(ClassifierTrainer):
    """:class:`ClassifierTrainer` whose architecture steps read their own part of the training
    split; see the module docstring.

    Args:
        config: an :class:`ArchSplitConfig`; keyword arguments override its fields.

    Raises:
        ValueError: ``arch_fraction`` leaves no example for the weights or the architecture.
    """

    config_class = ArchSplitConfig

    def to_spec(self) -> dict | None:
        """``{"class": ArchSplitTrainer, "config": ...}``: workers rebuild it from its settings."""
        config = dataclasses.asdict(self.config)
        if not isinstance(config["dataset"], str):
            return None
        config.update({k: v.default for k, v in self.value_choices().items()})
        return {"class": ref_of(ArchSplitTrainer), "config": config}

    def data_key(self, hparams: dict) -> str | None:
        return None  # its batches are its own: no sharing of a loader with other trainers

    def split_indices(self, hparams: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weight part, architecture part, validation split) as indices into the data set."""
        fraction, seed = (self.value(k, hparams) for k in ("val_fraction", "split_seed"))
        (_, y_train), (_, y_val) = self._split(hparams)
        n = len(y_train) + len(y_val)
        order = np.random.default_rng(seed).permutation(n)  # as ClassifierTrainer._split cuts
        n_val = int(round(n * float(fraction)))
        val, train = order[:n_val], order[n_val:]
        weights, arch = self._cut(len(train), hparams)
        return (torch.from_numpy(train[weights]), torch.from_numpy(train[arch]),
                torch.from_numpy(val))

    def _cut(self, n: int, hparams: dict) -> tuple[np.ndarray, np.ndarray]:
        """Positions in the training split of the weight part and of the architecture part."""
        fraction = float(self.value("arch_fraction", hparams))
        n_arch = int(round(n * fraction))
        if not 0 < n_arch < n:
            raise ValueError(f"arch_fraction={fraction} leaves no training example for the "
                             f"weights or none for the architecture steps out of {n}; use a "
                             f"value strictly between 0 and 1 (DARTS: 0.5)")
        order = np.random.default_rng(int(self.value("arch_seed", hparams))).permutation(n)
        return order[n_arch:], order[:n_arch]

    def _part(self, hparams: dict, epoch: int, part: int, salt: int) -> list:
        (x, y), _ = self._split(hparams)
        idx = torch.from_numpy(self._cut(len(x), hparams)[part])
        batch_size = int(self.value("batch_size", hparams))
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        order = np.random.default_rng([int(self.value("seed", hparams)), epoch, salt])
        idx = idx[torch.from_numpy(order.permutation(len(idx)))]
        return [(x[i], y[i]) for i in idx.split(batch_size)]

    def train_dataloader(self, hparams: dict, epoch: int) -> list:
        """The weight part, shuffled per epoch."""
        return self._part(hparams, epoch, 0, 0)

    def arch_dataloader(self, hparams: dict, epoch: int) -> list:
        """The architecture part, shuffled per epoch (its own order)."""
        return self._part(hparams, epoch, 1, 1)

    def describe_split(self, hparams: dict | None = None) -> dict[str, Any]:
        """Sizes of the three parts, for notes and docs."""
        weights, arch, val = self.split_indices(hparams or {})
        return {"weights": len(weights), "architecture": len(arch), "validation": len(val)}
