"""Weight Agnostic Neural Networks (Gaier & Ha, NeurIPS 2019): a network is judged over a sweep
of fixed shared weight values without training, and ranked by its mean performance and its
complexity.

:class:`WANNTrainer` scores a model whose one parameter is the shared weight: each validation
batch is run once per value of ``weights`` (WANN's ``[-2, -1, -0.5, 0.5, 1, 2]``) with the
weight set to it, and reports ``val_acc`` (the mean accuracy over the sweep),
``val_acc_max`` (the best single value's: exact when the validation data is one batch, as
digits' 360 images are; over several batches, the mean of each batch's best) and
``connections`` (the network's connections: the nonzero entries of every ``mask`` buffer,
one per unit-to-unit edge). Nothing is trained: the engine's one step per epoch runs SGD
with learning rate 0 (the engine requires an optimizer step), so the shared weight stays
where the sweep sets it.

:func:`wann_order` is WANN's ranking, framework-free: non-dominated fronts over (mean
performance, connections) in 80% of the rankings and over (mean performance, max
performance) in the other 20%, ties within a front broken by NSGA-II's crowding distance
(the largest first), as WANN's ``nsga_sort`` does.

Example:
    >>> wann_order([(0.9, 0.9, 20), (0.8, 0.9, 5), (0.5, 0.6, 30)], by_connections=True)
    [0, 1, 2]
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import nn

from .engine.trainers.trainer import ClassifierConfig, ClassifierTrainer
from .objectives import nsga_keys

__all__ = ["SWEEP", "WANNConfig", "WANNTrainer", "connections", "shared_weight",
           "wann_order"]

SWEEP = (-2.0, -1.0, -0.5, 0.5, 1.0, 2.0)  # WANN's series of shared weight values
# WANN ranks by (mean, connections) in this share of its rankings, else by (mean, max)
P_CONNECTIONS = 0.8


def wann_order(scores: Sequence[tuple[float, float, float]], by_connections: bool) -> list[int]:
    """Indices of ``scores`` (``(mean, max, connections)`` each; performances higher and
    connections fewer are better), best first: by non-dominated front over (mean,
    connections) when ``by_connections`` else over (mean, max), then by crowding distance
    within the front (largest first); equal keys keep their order."""
    points = [(-mean, conns) if by_connections else (-mean, -best)
              for mean, best, conns in scores]
    keys = nsga_keys(points)
    return sorted(range(len(scores)), key=lambda i: keys[i])


def shared_weight(model: nn.Module) -> nn.Parameter:
    """The model's one parameter, the weight every connection shares.

    Raises:
        ValueError: the model has no parameter or several (naming them).
    """
    params = list(model.named_parameters())
    if len(params) != 1 or params[0][1].numel() != 1:
        raise ValueError(f"a weight-agnostic network has one shared scalar weight; this model "
                         f"has {[(n, tuple(p.shape)) for n, p in params]} (build it from "
                         f"model_spaces.wann)")
    return params[0][1]


def connections(model: nn.Module) -> int:
    """The network's connections: nonzero entries of its modules' ``mask`` buffers."""
    return int(sum(int(torch.count_nonzero(m.mask)) for m in model.modules()
                   if isinstance(getattr(m, "mask", None), torch.Tensor)))


@dataclasses.dataclass
class WANNConfig(ClassifierConfig):
    """:class:`ClassifierConfig` for weight-agnostic scoring: nothing trains."""

    weights: tuple = SWEEP  # the sweep of shared values each model is scored over
    epochs: int = 1  # one pass of scoring: there is nothing to train over epochs
    optimizer: str = "sgd"
    lr: float = 0.0  # the engine's step changes nothing: the weight is swept, never learnt
    momentum: float = 0.0


class WANNTrainer(ClassifierTrainer):
    """Scores weight-agnostic networks over a sweep of shared values (see the module).

    Example::

        trainer = WANNTrainer(dataset="digits")                # WANN's sweep
        Experiment(space, "wann", trainer, metric=["val_acc", "connections", "val_acc_max"],
                   mode=["max", "min", "max"])
    """

    config_class = WANNConfig

    def __init__(self, config: WANNConfig | None = None, **overrides: Any):
        super().__init__(config, **overrides)
        weights = self.config.weights
        if not weights or not all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                  for w in weights):
            raise ValueError(f"WANNTrainer: weights must be a non-empty list of numbers, got "
                             f"{weights!r}")
        if self.config.lr != 0:
            raise ValueError(f"WANNTrainer: lr={self.config.lr}: a weight-agnostic network is "
                             f"never trained (its shared weight is swept); leave lr at 0")

    def to_spec(self) -> dict | None:
        from .codec import ref_of

        config = dataclasses.asdict(self.config)
        config["weights"] = list(config["weights"])
        if not isinstance(config["dataset"], str):
            return None
        return {"class": ref_of(WANNTrainer), "config": config}

    def train_dataloader(self, hparams: dict, epoch: int) -> list:
        return super().train_dataloader(hparams, epoch)[:1]  # the engine's one (null) step

    def training_step(self, model: nn.Module, batch: Any, hparams: dict) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def validation_step(self, model: nn.Module, batch: Any) -> dict[str, Any]:
        x, y = batch
        weight = shared_weight(model)
        saved = weight.detach().clone()
        accs = []
        with torch.no_grad():
            for value in self.config.weights:
                weight.fill_(float(value))
                accs.append(float((model(x).argmax(dim=1) == y).float().mean()))
            weight.copy_(saved)
        return {"val_acc": sum(accs) / len(accs), "val_acc_max": max(accs),
                "connections": float(connections(model))}
