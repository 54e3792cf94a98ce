"""A small one-shot strategy and a tiny space for the one-shot engine tests.

:class:`PerArchitecture` is a :class:`~retiarii.strategies.one_shot.OneShot` strategy that
works on any finite space: it keeps one set of weights per architecture (shared by every
segment that samples it, so state flows from segment to segment through the unit), samples
``models_per_segment`` architectures per segment with its own generator, trains each on a few
batches and evaluates it. Enough to test what the engine owns (jobs, units, store, resume)
without waiting for the real strategies. Workers load it by reference, so it lives here at
module level (``tests/`` is not a package: specs use this file's path).
"""
from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn

import retiarii as rt
from retiarii.strategies.one_shot.base import EvaluatedModel, OneShot, SegmentContext, SegmentResult


class PerArchitecture(OneShot):
    """Weights per architecture, shared across segments; see the module docstring.

    Args:
        epochs: segments of the search.
        models_per_segment: architectures sampled (with replacement) and trained per segment.
        batches: training batches per sampled architecture.
        seed: seeds the sampling generator.
        refuse: a choice label this strategy refuses (a "bad space" for it): ``setup`` raises.
        die_in_segment, die_marker: SIGKILL the worker as segment ``die_in_segment`` starts,
            once (the file ``die_marker`` remembers it happened, so the retry runs).
        sleep_s: seconds each segment waits before it trains (a window to kill the driver
            in); changes nothing it computes.
    """

    def __init__(self, epochs: int = 3, models_per_segment: int = 2, batches: int = 2,
                 seed: int = 0, refuse: str = "", die_in_segment: int = -1, die_marker: str = "",
                 sleep_s: float = 0.0):
        self.epochs, self.models_per_segment, self.batches = epochs, models_per_segment, batches
        self.seed, self.refuse = seed, refuse
        self.die_in_segment, self.die_marker = die_in_segment, die_marker
        self.sleep_s = sleep_s

    def setup(self, space, trainer, hparams, device) -> None:
        models = list(space.enumerate())
        labels = sorted({label for m in models for label in m.sample})
        if self.refuse in labels:
            raise ValueError(f"PerArchitecture cannot search the choice {self.refuse!r} of this "
                             f"space: give a space without it")
        self._samples = [dict(m.sample) for m in models]
        self._nets = nn.ModuleList([space.build(s) for s in self._samples]).to(device)
        self._opt = torch.optim.SGD(self._nets.parameters(), lr=0.05, momentum=0.9)
        self._gen = torch.Generator().manual_seed(self.seed)
        self._scores: dict[int, float] = {}
        self._device = device

    def num_segments(self) -> int:
        return self.epochs

    def run_segment(self, ctx: SegmentContext) -> SegmentResult:
        if ctx.segment == self.die_in_segment and not os.path.exists(self.die_marker):
            open(self.die_marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.sleep_s)
        picks = torch.randint(len(self._samples), (self.models_per_segment,),
                              generator=self._gen).tolist()
        train = [(x.to(self._device), y.to(self._device))
                 for x, y in list(ctx.train_batches())[:self.batches]]
        valid = [(x.to(self._device), y.to(self._device)) for x, y in ctx.valid_batches()]
        losses, models = [], []
        for i in picks:
            net = self._nets[i]
            net.train()
            for batch in train:
                loss = ctx.trainer.training_step(net, batch, ctx.hparams)
                self._opt.zero_grad()
                loss.backward()
                self._opt.step()
                losses.append(loss.item())
            net.eval()
            with torch.no_grad():
                acc = sum(ctx.trainer.validation_step(net, b)["val_acc"].item() * len(b[1])
                          for b in valid) / sum(len(b[1]) for b in valid)
            self._scores[i] = acc
            models.append(EvaluatedModel(self._samples[i], {"val_acc": acc}))
        return SegmentResult({"train_loss": sum(losses) / len(losses)}, models)

    def state_dict(self) -> dict:
        return {"nets": self._nets.state_dict(), "opt": self._opt.state_dict(),
                "gen": self._gen.get_state(),
                "scores": {str(i): v for i, v in self._scores.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._nets.load_state_dict(state["nets"])
        self._opt.load_state_dict(state["opt"])
        self._gen.set_state(state["gen"])
        self._scores = {int(i): v for i, v in state["scores"].items()}

    def selected(self) -> dict:
        if not self._scores:
            return dict(self._samples[0])
        best = max(sorted(self._scores), key=lambda i: self._scores[i])
        return dict(self._samples[best])

    def export_state(self, sample: dict) -> dict:
        return self._nets[self._samples.index(sample)].state_dict()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(64, 16)
        self.act = rt.LayerChoice({"relu": nn.ReLU(), "tanh": nn.Tanh()}, label="act")
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.flatten(x))))


space = rt.ModelSpace(MLP(), example_input=torch.zeros(2, 1, 8, 8))  # 2 architectures
trainer = rt.Trainer(dataset="digits", epochs=1, batch_size=128)
strategy = PerArchitecture(epochs=3)  # what `retiarii run one_shot_helpers.py` searches with



class Wide(MLP):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 32), nn.Linear(32, 10)


# Two base models (the choice labelled "base" picks one): a structural choice that no
# continuous relaxation mixes, which DARTS refuses in its setup.
two_bases = rt.ModelSpace([MLP(), Wide()], example_input=torch.zeros(2, 1, 8, 8))
