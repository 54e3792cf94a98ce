"""What the strategies that train their own super-network module share (Single-Path NAS's
super-kernels, Once-for-All's elastic network): the mobile skeleton's fixed parts, the
trainer's optimizer over a module, seeded segments and evaluation by the trainer's metrics.

These strategies do not use the engine's super-graph (:mod:`retiarii.optim.supergraph`): their
candidates share *parts of one tensor* (a 3x3 kernel is the centre of the 5x5, an expansion
the first channels of a wider one), which a super-graph of whole operators cannot express.
The space tells them its skeleton through a ``macro`` dict set by its builder (see
``model_spaces/proxylessnas.py`` and ``model_spaces/once_for_all.py``).

Example::

    net = MobileSkeleton(macro, body)        # stem, fixed first block, body, head, classifier
    opt = trainer_optimizer(trainer, net.weights_module(), hparams)
"""
from __future__ import annotations

import contextlib
import random
from typing import Any, Iterable

import torch
from torch import nn

__all__ = ["MobileSkeleton", "average_metrics", "macro_of", "seeded", "trainer_optimizer"]


def macro_of(space: Any, owner: str, kind: str, example: str) -> dict:
    """``space.macro`` when it describes a ``kind`` super-network, else a ValueError naming
    a space that does (``example``)."""
    macro = getattr(space, "macro", None)
    if not isinstance(macro, dict) or macro.get("kind") != kind:
        raise ValueError(f"{owner} builds its own super-network from the space's skeleton "
                         f"(space.macro of kind {kind!r}); this space has none. Use {example} "
                         f"or a space whose builder sets space.macro")
    return macro


def conv_bn(c_in: int, c_out: int, kernel: int = 1, stride: int = 1, groups: int = 1,
            act: type | None = nn.ReLU6) -> nn.Sequential:
    """k x k conv (no bias, 'same' padding), BN, then ``act`` unless None."""
    layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2,
                                         groups=groups, bias=False), nn.BatchNorm2d(c_out)]
    return nn.Sequential(*layers, *([act()] if act is not None else []))


class _FirstBlock(nn.Module):
    """MobileNetV2's first block (depthwise 3x3, no expansion), as the spaces fix it."""

    def __init__(self, c_in: int, c_out: int, act: type):
        super().__init__()
        self.body = nn.Sequential(conv_bn(c_in, c_in, 3, groups=c_in, act=act),
                                  conv_bn(c_in, c_out, 1, act=None))
        self.residual = c_in == c_out

    def forward(self, x):
        out = self.body(x)
        return out + x if self.residual else out


class MobileSkeleton(nn.Module):
    """stem ─▶ first block ─▶ ``body`` ─▶ 1x1 head ─▶ pool ─▶ classifier, the spaces' skeleton.

    ``body(x, config)`` is the searched part; ``config`` is what the strategy passes to select
    a sub-network (None: the super-network as it is). ``macro`` has ``in_channels``,
    ``num_classes``, ``stem``, ``stem_stride``, ``first``, ``last``, ``head``.
    """

    def __init__(self, macro: dict, body: nn.Module, act: type = nn.ReLU6,
                 first_act: type = nn.ReLU6):
        super().__init__()
        self.stem = conv_bn(macro["in_channels"], macro["stem"], 3, macro["stem_stride"],
                            act=act)
        self.first = _FirstBlock(macro["stem"], macro["first"], first_act)
        self.body = body
        self.head = conv_bn(macro["last"], macro["head"], 1, act=act)
        self.fc = nn.Linear(macro["head"], macro["num_classes"])
        self.config: Any = None  # the sub-network forward() runs (the body reads it)

    def forward(self, x):
        x = self.body(self.first(self.stem(x)), self.config)
        # (B, head, H, W) -> (B, head) -> (B, num_classes)
        return self.fc(self.head(x).mean((2, 3)))


def trainer_optimizer(trainer: Any, module: nn.Module, hparams: dict) -> torch.optim.Optimizer:
    """The optimizer ``trainer.configure_optimizers`` builds over ``module`` (a scheduler it
    returns too is not used: these searches run for a fixed number of segments)."""
    out = trainer.configure_optimizers(module, hparams)
    if isinstance(out, dict):
        out = out["optimizer"]
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.optim.Optimizer):
        raise TypeError(f"trainer.configure_optimizers returned {type(out).__name__}; these "
                        f"strategies need an optimizer (or (optimizer, scheduler))")
    return out


@contextlib.contextmanager
def seeded(seed: int, segment: int, purpose: str):
    """Torch's and Python's global streams seeded from (seed, segment, purpose) for the block
    and restored after: a resumed segment draws what an uninterrupted one draws."""
    g = random.Random(f"{seed}:{segment}:{purpose}")
    state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(g.randrange(2 ** 62))
        random.seed(g.randrange(2 ** 62))
        try:
            yield g
        finally:
            random.setstate(state)


def average_metrics(trainer: Any, net: nn.Module, batches: Iterable, device) -> dict:
    """``trainer.validation_step`` averaged over ``batches`` (net in eval mode, no grad)."""
    from ...training import to_device

    net.eval()
    sums: dict[str, float] = {}
    n = 0
    with torch.no_grad():
        for batch in batches:
            for k, v in trainer.validation_step(net, to_device(batch, device)).items():
                sums[k] = sums.get(k, 0.0) + float(v)
            n += 1
    return {k: v / max(n, 1) for k, v in sums.items()}
