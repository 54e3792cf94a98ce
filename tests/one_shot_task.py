"""A synthetic task where one model of a small space is clearly best, for one-shot strategies.

The target is linear, ``y = A x``. The space has two inline choices: ``op`` among a trainable
linear map (it can fit ``A``), a zero op and a skip connection (neither can, having no
weights: a frozen layer inside a choice would not do, since a candidate a mutation puts in
has weights of its own that train, docs/optimization.md), and
``act`` between the identity and a ReLU (which clips half of the outputs). The best model is
``{"op": "linear", "act": "identity"}``: its validation loss goes to ~0 while every other
model keeps a loss of the order of the target's variance. The trainer reports ``val_loss``
(MSE) and ``val_acc = -val_loss`` so strategies that rank by the default metric work as is.
"""
from __future__ import annotations

import io

import torch
from torch import nn

import retiarii as rt
from retiarii.engine.trainers.trainer import Trainer
from retiarii.strategies.one_shot.base import SegmentContext

DIM = 8
BEST = {"op": "linear", "act": "identity"}


class Zero(nn.Module):
    def forward(self, x):
        return x * 0.0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.op = rt.LayerChoice({"linear": nn.Linear(DIM, DIM), "zero": Zero(),
                                  "skip": nn.Identity()}, label="op")
        self.act = rt.LayerChoice({"identity": nn.Identity(), "relu": nn.ReLU()}, label="act")

    def forward(self, x):
        return self.act(self.op(x))


class BNNet(nn.Module):
    """The same choice of ``op``, followed by a BatchNorm (whose statistics every path
    shares): for the recalibration of BatchNorm statistics per path."""

    def __init__(self):
        super().__init__()
        self.op = rt.LayerChoice({"linear": nn.Linear(DIM, DIM), "zero": Zero(),
                                  "skip": nn.Identity()}, label="op")
        self.bn = nn.BatchNorm1d(DIM)

    def forward(self, x):
        return self.bn(self.op(x))


def make_bn_space() -> rt.ModelSpace:
    torch.manual_seed(0)
    return rt.ModelSpace(BNNet(), example_input=torch.randn(2, DIM))


def make_space() -> rt.ModelSpace:
    torch.manual_seed(0)
    return rt.ModelSpace(Net(), example_input=torch.randn(2, DIM))


class LinearTask(Trainer):
    """Regression onto ``y = A x``; each epoch's batches follow from (seed, epoch) only."""

    def __init__(self, batches: int = 16, batch_size: int = 32, lr: float = 0.1,
                 val_batches: int = 2):
        g = torch.Generator().manual_seed(7)
        self.a = torch.randn(DIM, DIM, generator=g) / DIM ** 0.5  # y has unit variance
        self.batches, self.batch_size, self.lr = batches, batch_size, lr
        self.x_val = torch.randn(val_batches * batch_size, DIM, generator=g)

    def _batch(self, x):
        return x, x @ self.a.T  # (B, DIM) -> (B, DIM)

    def train_dataloader(self, hparams, epoch):
        g = torch.Generator().manual_seed(1000 + epoch)
        return [self._batch(torch.randn(self.batch_size, DIM, generator=g))
                for _ in range(self.batches)]

    def val_dataloader(self, hparams):
        return [self._batch(x) for x in self.x_val.split(self.batch_size)]

    def configure_optimizers(self, model, hparams):
        return torch.optim.Adam(model.parameters(), lr=self.lr)

    def training_step(self, model, batch, hparams):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def validation_step(self, model, batch):
        x, y = batch
        loss = nn.functional.mse_loss(model(x), y)
        return {"val_loss": loss, "val_acc": -loss}


def run(strategy, space, trainer, segments: range | None = None, hparams=None):
    """Runs ``segments`` (default: all) of a set-up strategy by hand; returns the results."""
    hparams = hparams or {}
    segments = segments if segments is not None else range(strategy.num_segments())
    return [strategy.run_segment(SegmentContext(seg, trainer, hparams, torch.device("cpu")))
            for seg in segments]


def roundtrip(state):
    """``state`` saved and loaded as the engine does with a unit (``weights_only=True``)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_numbers(results):
    """What the engine records: every metric a plain number (of a segment and of a model)."""
    for result in results:
        for metrics in [result.metrics, *(m.metrics for m in result.models)]:
            bad = {k: v for k, v in metrics.items()
                   if isinstance(v, bool) or not isinstance(v, (int, float))}
            assert not bad, bad
