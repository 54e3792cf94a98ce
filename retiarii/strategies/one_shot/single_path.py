"""Single-Path NAS (Stamoulis et al., "Single-Path NAS: Designing Hardware-Efficient ConvNets in
less than 4 Hours", ECML-PKDD 2019): one super-kernel per layer, whose thresholds on weight
norms choose the kernel, the expansion and the skip, learnt together with the weights.

Every searched layer of the space is one :class:`~retiarii.optim.superkernel.SuperKernelMBConv`
(the 3x3 the 5x5's centre, expansion 3 the first channels of 6). One loss trains weights and
thresholds on the training batches, as the paper::

    loss = CE + lambda * log(R),    R = base + sum_l R_l(indicators of layer l)
    R_l  = skip_l + use * (body_l - skip_l)                       (layers that can be skipped)
    body = small + kernel * (large - small)
    small = c(k3_e3) + wide * (c(k3_e6) - c(k3_e3)),  large: the same with k5

where ``c`` is the layer's entry of the operator-latency table
(:func:`retiarii.engine.op_latency.choice_latencies`: each candidate's cost over the base
model's) and ``base`` the base model's predicted latency: R is the predicted latency of the
architecture the indicators select, differentiable through their straight-through sigmoids.
After each segment the architecture the thresholds select (:meth:`SuperKernelMBConv.derive`,
named as the space's candidates) is evaluated on the super-network and recorded.

Example::

    s = SinglePathNAS(epochs=5, latency=choice_latencies(space, table), base_latency=2.1,
                      latency_weight=0.1)
    s.setup(space, trainer, {}, torch.device("cpu"))
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ...optim.superkernel import SuperKernelMBConv
from .base import EvaluatedModel, OneShot, SegmentContext, SegmentResult
from .shared_training import check_positive, check_state
from .supernet import MobileSkeleton, average_metrics, macro_of, seeded, trainer_optimizer

__all__ = ["SinglePathNAS", "runtime"]


class _Body(nn.Module):
    """The searched layers, in order: (B, C, H, W) -> (B, C_last, H', W')."""

    def __init__(self, layers: list[SuperKernelMBConv], labels: list[str]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.labels = labels

    def forward(self, x, config=None):
        for layer in self.layers:
            x = layer(x)
        return x


def runtime(layers, labels, latency: dict, base: float) -> torch.Tensor:
    """R: ``base`` plus each layer's cost selected by its indicators (see the module
    docstring); candidates missing from ``latency`` cost 0."""
    total = torch.tensor(float(base))
    for layer, label in zip(layers, labels):
        table = latency.get(label, {})
        kernel, use, wide, _ = layer.gates()

        def c(k, e):
            return float(table.get(f"k{k}_e{e}", 0.0))

        ks, kl, es, el = layer.k_small, layer.k_large, layer.e_small, layer.e_large
        small = c(ks, es) + wide * (c(ks, el) - c(ks, es))
        large = c(kl, es) + wide * (c(kl, el) - c(kl, es))
        body = small + kernel * (large - small)
        if layer.skip:
            skip = float(table.get("skip", 0.0))
            body = skip + use * (body - skip)
        total = total + body
    return total


class SinglePathNAS(OneShot):
    """Super-kernels with thresholds learnt by gradient, with the runtime term.

    Args:
        epochs: segments, one epoch of the training batches each.
        latency: ``{label: {candidate: ms}}`` over the base model's (None: no runtime term).
        base_latency: the base model's predicted latency (ms): R's constant, so that
            ``log(R)`` is the log of a latency (required with ``latency``).
        latency_weight: lambda of ``lambda * log(R)``.
        threshold_lr: Adam's rate for the thresholds (the weights take the trainer's
            optimizer); the sigmoid's slope at a norm far from its threshold is tiny, and
            Adam's normalised step still moves it.
        eval_batches: validation batches per evaluation (None: all).
        metric: the validation metric reported as the selected architecture's.
        seed: seeds the initial weights and each segment's streams.
    """

    def __init__(self, epochs: int = 5, latency: dict | None = None,
                 base_latency: float | None = None, latency_weight: float = 0.1,
                 threshold_lr: float = 0.05, eval_batches: int | None = None,
                 metric: str = "val_acc", seed: int = 0):
        check_positive("SinglePathNAS", epochs=epochs)
        if eval_batches is not None:
            check_positive("SinglePathNAS", eval_batches=eval_batches)
        if latency is not None and not (isinstance(latency, dict) and all(
                isinstance(t, dict) for t in latency.values())):
            raise ValueError(f"SinglePathNAS: latency must be {{label: {{candidate: ms}}}}, "
                             f"got {latency!r}")
        if latency is not None and base_latency is None:
            raise ValueError("SinglePathNAS: a latency table needs base_latency, the base "
                             "model's predicted ms (OpLatencyTable.predict), so that log(R) is "
                             "the log of a latency")
        if latency_weight < 0 or threshold_lr < 0:
            raise ValueError(f"SinglePathNAS: latency_weight and threshold_lr must be >= 0, got "
                             f"{latency_weight!r} and {threshold_lr!r}")
        self.epochs = epochs
        self.latency = {str(k): {str(c): float(v) for c, v in t.items()}
                        for k, t in (latency or {}).items()}
        self.base_latency = None if base_latency is None else float(base_latency)
        self.latency_weight = float(latency_weight)
        self.threshold_lr = float(threshold_lr)
        self.eval_batches = eval_batches
        self.metric = metric
        self.seed = seed
        self._net: MobileSkeleton | None = None
        self._best: tuple[dict, dict] | None = None

    def config(self) -> dict:
        return {"epochs": self.epochs, "latency": self.latency,
                "base_latency": self.base_latency, "latency_weight": self.latency_weight,
                "threshold_lr": self.threshold_lr, "eval_batches": self.eval_batches,
                "metric": self.metric, "seed": self.seed}

    def setup(self, space: Any, trainer: Any, hparams: dict, device: torch.device) -> None:
        macro = macro_of(space, "SinglePathNAS", "super_kernel",
                         'model_spaces.proxylessnas.small("single_path_nas")')
        self._space, self._trainer, self._hparams, self._device = space, trainer, hparams, device
        base = space.default_sample()
        labels = [label for label, *_ in macro["layers"]]
        if sorted(labels) != sorted(base):
            raise ValueError(f"SinglePathNAS: space.macro names layers {labels} but the space's "
                             f"choices are {sorted(base)}")
        for label in self.latency:
            if label not in base:
                raise ValueError(f"SinglePathNAS: latency table label {label!r} is not a "
                                 f"choice of the space; its choices are {sorted(base)}")
        with seeded(self.seed, -1, "init"):
            layers = [SuperKernelMBConv(c_in, c_out, stride, tuple(macro["kernels"]),
                                        tuple(macro["expansions"]), skip=skip)
                      for _, c_in, c_out, stride, skip in macro["layers"]]
            self._net = MobileSkeleton(macro, _Body(layers, labels)).to(device)
        thresholds = [p for n, p in self._net.named_parameters() if n.endswith("thresholds")]
        weights = nn.ParameterList([p for n, p in self._net.named_parameters()
                                    if not n.endswith("thresholds")])
        self._opt = trainer_optimizer(trainer, weights, hparams)
        self._opt_t = torch.optim.Adam(thresholds, lr=self.threshold_lr)
        self._best = None

    def num_segments(self) -> int:
        return self.epochs

    def runtime(self) -> torch.Tensor:
        """R of the architecture the indicators select now (ms)."""
        body = self._body()
        return runtime(body.layers, body.labels, self.latency, self.base_latency or 0.0)

    def derive(self) -> dict:
        """The space's sample the thresholds select: ``{label: "skip" | "k{k}_e{e}"}``."""
        body = self._body()
        return {label: layer.derive() for label, layer in zip(body.labels, body.layers)}

    def _body(self) -> _Body:
        if self._net is None:
            raise RuntimeError("SinglePathNAS: call setup(space, trainer, hparams, device) first")
        return self._net.body

    def run_segment(self, ctx: SegmentContext) -> SegmentResult:
        from ...training import to_device

        net = self._net
        if net is None:
            raise RuntimeError("SinglePathNAS.run_segment(): call setup(...) first")
        if not 0 <= ctx.segment < self.epochs:
            raise ValueError(f"SinglePathNAS: segment {ctx.segment} is out of range 0.."
                             f"{self.epochs - 1}")
        losses, runtimes = [], []
        with seeded(self.seed, ctx.segment, "train"):
            net.train()
            for batch in ctx.train_batches():
                if ctx.should_stop():
                    break
                self._opt.zero_grad(set_to_none=True)
                self._opt_t.zero_grad(set_to_none=True)
                loss = ctx.trainer.training_step(net, to_device(batch, ctx.device), ctx.hparams)
                if self.latency:
                    r = self.runtime()
                    if float(r.detach()) <= 0:
                        raise FloatingPointError(f"SinglePathNAS: predicted runtime {float(r.detach())} "
                                                 f"ms <= 0: base_latency is too small for the "
                                                 f"table's (negative) entries")
                    loss = loss + self.latency_weight * torch.log(r)
                    runtimes.append(float(r.detach()))
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise FloatingPointError(f"SinglePathNAS: the loss is {value}; lower the "
                                             f"learning rate")
                loss.backward()
                self._opt.step()
                self._opt_t.step()
                losses.append(value)
            sample = self.derive()
            valid = ctx.valid_batches()
            if self.eval_batches is not None:
                valid = list(valid)[:self.eval_batches]
            metrics = average_metrics(ctx.trainer, net, valid, ctx.device)
        if self.metric not in metrics:
            raise KeyError(f"SinglePathNAS reports {self.metric!r} but the trainer's "
                           f"validation_step returned {sorted(metrics)}; pass metric= one of "
                           f"those")
        with torch.no_grad():
            metrics["latency_ms"] = float(self.runtime()) if self.latency else 0.0
        self._best = (sample, metrics)
        out = {"train_loss": sum(losses) / max(len(losses), 1), "batches": len(losses),
               **{f"threshold_{i}": float(t) for i, t in enumerate(
                   torch.stack([lay.thresholds.detach() for lay in self._body().layers]).mean(0))}}
        if runtimes:
            out["runtime_ms"] = sum(runtimes) / len(runtimes)
        return SegmentResult(out, [EvaluatedModel(sample, {**metrics, "segment": ctx.segment})])

    def selected(self) -> dict:
        """The architecture the thresholds select now (the last segment's)."""
        return self.derive()

    def state_dict(self) -> dict:
        if self._net is None:
            raise RuntimeError("SinglePathNAS.state_dict(): call setup(space, ...) first")
        return {"strategy": "SinglePathNAS", "config": self.config(),
                "net": self._net.state_dict(), "opt": self._opt.state_dict(),
                "opt_t": self._opt_t.state_dict(),
                "best": None if self._best is None else [self._best[0], self._best[1]]}

    def load_state_dict(self, state: dict) -> None:
        if self._net is None:
            raise RuntimeError("SinglePathNAS.load_state_dict(): call setup(space, ...) first")
        check_state("SinglePathNAS", state, self.config())
        self._net.load_state_dict(state["net"])
        self._opt.load_state_dict(state["opt"])
        self._opt_t.load_state_dict(state["opt_t"])
        self._best = None if state["best"] is None else (dict(state["best"][0]),
                                                         dict(state["best"][1]))
