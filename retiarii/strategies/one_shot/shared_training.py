"""Training and evaluating sampled paths of a super-graph: what SPOS, ENAS and
:class:`~retiarii.strategies.WeightSharing` have in common.

:class:`SharedTraining` owns a :class:`~retiarii.optim.supergraph.SuperGraph` and the optimizer
the trainer configures over its parameters. ``train(sample, batch, ctx)`` runs one batch of one
path (the loss from ``trainer.training_step``; on several ranks each shared weight's gradient is
averaged over the ranks that used it before the step); ``evaluate(sample, batches)`` averages
``trainer.validation_step`` over batches with the inherited weights, optionally after
recalibrating the path's BatchNorm statistics (as SPOS does: statistics accumulated over the
mixture of paths fit no single path). The strategy's own RNG streams (python, numpy, torch)
are swapped in while it runs (:meth:`SharedTraining.own_rng`), so dropout and sampling in a
segment follow from the saved state only and a resumed search continues bit for bit.

Example (any space the super-graph takes, any trainer)::

    st = SharedTraining(space, trainer, {}, torch.device("cpu"), seed=0)
    with st.own_rng():
        loss = st.train(sample, next(iter(trainer.train_dataloader({}, 0))), ctx)
        metrics = st.evaluate(sample, trainer.val_dataloader({}))
"""
from __future__ import annotations

import contextlib
import itertools
import math
import random
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class _ParamsOf(nn.Module):
    """What ``trainer.configure_optimizers(model, hparams)`` is given: a module whose
    ``parameters()`` and ``named_parameters()`` are the super-graph's (a trainer builds its
    optimizer from those; it never runs this module)."""

    def __init__(self, supergraph: Any):
        super().__init__()
        self._sg = supergraph

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return iter(list(self._sg.parameters()))

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        # (a trainer that groups parameters by name, e.g. no weight decay on biases)
        for name, p in self._sg.named_parameters():
            yield f"{prefix}{name}", p


def segment_rng(seed: int, segment: int, rank: int, purpose: str) -> random.Random:
    """A generator for one purpose of one segment on one rank: a pure function of its
    arguments, so a resumed segment draws what an uninterrupted one draws and each rank of a
    mixed-parallel job samples its own paths.

    Example:
        >>> segment_rng(0, 1, 0, "train").random() == segment_rng(0, 1, 0, "train").random()
        True
    """
    # str seeds hash with sha512 in Python 3: stable across processes and platforms.
    return random.Random(f"{seed}:{segment}:{rank}:{purpose}")


def rank_rngs(seed: int, segment: int, world: int, purpose: str) -> list[random.Random]:
    """One generator per rank (:func:`segment_rng` of each rank). Every rank advances all of
    them and draws every rank's path (see :meth:`SharedTraining.own_path`)."""
    return [segment_rng(seed, segment, r, purpose) for r in range(world)]


def take(batches: Iterable, n: int | None) -> list:
    """The first ``n`` items of ``batches`` (all of them for ``None``)."""
    return list(batches) if n is None else list(itertools.islice(batches, n))


def check_positive(owner: str, **values: Any) -> None:
    """Raises a ValueError naming the first argument that is not a positive int."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


def check_shared(owner: str, shared: Any) -> list[str] | None:
    """``shared`` as a list of module path patterns (None stays None), or a ValueError naming
    the owner and the fix."""
    if shared is None:
        return None
    if isinstance(shared, str) or not isinstance(shared, (list, tuple)) or not shared or \
            not all(isinstance(p, str) and p for p in shared):
        raise ValueError(f"{owner}: shared={shared!r}: give a non-empty list of module path "
                         "patterns, e.g. ['stem', 'cells.*'] (or None: share every operator)")
    return list(shared)


def mean_over_ranks(values: dict[str, float], ctx: Any) -> dict[str, float]:
    """``values`` averaged over the ranks of ``ctx`` (itself on one process): on several ranks
    each evaluates on its own share of the validation data, and every rank must rank the
    candidates alike so that their searches stay identical."""
    if ctx.world <= 1 or not values:
        return values
    import torch.distributed as dist

    names = sorted(values)
    # on the segment's device: NCCL reduces GPU tensors only (gloo takes either)
    t = torch.tensor([values[n] for n in names], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, group=ctx.group)  # sum over ranks
    return {n: float(v) / ctx.world for n, v in zip(names, t.tolist())}


class ExportsInherited:
    """What SPOS, ENAS and WeightSharing share: ``export_state`` of a model's inherited
    weights from their super-graph (``self._shared``, a :class:`SharedTraining` after setup)."""

    _shared: "SharedTraining | None"

    def export_state(self, sample: dict) -> dict[str, torch.Tensor]:
        """The weights ``sample`` inherits from the super-graph, as the ``state_dict`` of
        ``space.build(sample)`` (what the engine exports with the selected model)."""
        if self._shared is None:
            raise RuntimeError(f"{type(self).__name__}.export_state(): call setup(space, ...) "
                               f"first")
        self._shared.net(sample)  # (under a device budget: its operators loaded first)
        return self._shared.supergraph.export_state(sample)

    def limit_memory(self, memory: float | None) -> None:
        """Hold at most ``memory`` bytes of shared weights (with their optimizer state) on the
        device (``device_memory``); the rest stays in host memory. SPOS and ENAS split their
        training segments over the ranks as :mod:`retiarii.optim.split` decides; every path
        evaluated (and each model WeightSharing trains, on its one rank) first loads its
        operators, parking the least recently added others. Call after ``setup``, before
        ``load_state_dict``; None: no limit."""
        if self._shared is None:
            raise RuntimeError(f"{type(self).__name__}.limit_memory(): call setup(space, ...) "
                               f"first")
        self._shared.limit_memory(memory)


def ready(strategy: Any, shared: "SharedTraining | None", ctx: Any) -> "SharedTraining":
    """``shared`` once ``setup`` built it and ``ctx.segment`` is one of the strategy's."""
    name = type(strategy).__name__
    if shared is None:
        raise RuntimeError(f"{name}.run_segment(): call setup(space, trainer, hparams, device) "
                           f"first")
    if not 0 <= ctx.segment < strategy.num_segments():
        raise ValueError(f"{name}: segment {ctx.segment} is out of range; this search has "
                         f"segments 0..{strategy.num_segments() - 1}")
    return shared


def check_state(name: str, state: Any, config: dict) -> None:
    """Raises a ValueError unless ``state`` was saved by strategy ``name`` with ``config``."""
    if not isinstance(state, dict) or state.get("strategy") != name:
        saved = state.get("strategy") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{name}.load_state_dict: the state was saved by {saved!r}; restore "
                         f"it into that strategy")
    if state["config"] != config:
        raise ValueError(f"{name}.load_state_dict: the state was saved with {state['config']} "
                         f"but this strategy has {config}; construct it with the saved "
                         f"settings")


class SharedTraining:
    """A super-graph, its optimizer and LR scheduler, and the strategy's RNG streams.

    Args:
        space: the model space (a :class:`~retiarii.ModelSpace`).
        trainer: gives ``configure_optimizers``, ``training_step`` and ``validation_step``.
        hparams: handed to every trainer call.
        device: where the shared weights live.
        seed: seeds the initial weights and the RNG streams of training (dropout).
        shared: the operators whose weights are shared (module path patterns; the others are
            private to each architecture); None: all (see :class:`SuperGraph`).
    """

    def __init__(self, space: Any, trainer: Any, hparams: dict, device: torch.device,
                 seed: int, shared: list[str] | None = None):
        from ... import rng as ckpt
        from ...training import parse_optimizers as _parse_optimizers
        from ...optim.supergraph import SuperGraph

        self.space, self.trainer, self.hparams = space, trainer, dict(hparams)
        self.device = torch.device(device)
        outer = ckpt.native_rng()
        try:
            ckpt.seed_rng(seed)
            # (the super-graph seeds each operator from (seed, its key): the same initial
            # weights whatever order paths arrive in, so every rank starts alike)
            self.supergraph = SuperGraph(space, device=self.device, seed=seed, shared=shared)
            # The pool grows as paths are asked for; the default path makes sure the optimizer
            # starts with parameters (torch refuses an empty list), the rest join via attach.
            self.supergraph.path(space.default_sample())
            out = trainer.configure_optimizers(_ParamsOf(self.supergraph), self.hparams)
            self.optimizer, self.scheduler, self.interval = _parse_optimizers(out)
            self.supergraph.attach(self.optimizer)
            self._rng = ckpt.native_rng()
        finally:
            ckpt.set_native_rng(outer)
        # a split super-graph (split_training.py): the device budget, the host copies, the run
        self.memory: float | None = None
        self._unit: Any = None
        self._parked: dict = {}
        self._split: Any = None

    def limit_memory(self, memory: float | None) -> None:
        """Hold at most ``memory`` bytes of shared weights (and their optimizer state) on the
        device: the rest stays in host memory and segments plan a split
        (:mod:`retiarii.optim.split`). Call it before :meth:`load_state_dict`; None: no
        limit (the whole pool on the device)."""
        from .split_training import load_unit

        if memory is not None and (isinstance(memory, bool) or not memory > 0):
            raise ValueError(f"device_memory must be positive bytes, got {memory!r}")
        if memory is None:
            if self.memory is not None:  # everything back on the device
                state = self.state_dict()
                self.memory = None
                self.load_state_dict(state)
            return
        if self.memory is None:
            state = self.state_dict()
            self.memory = float(memory)
            load_unit(self, state)
        self.memory = float(memory)

    def split_segment(self, samples: list, ctx: Any) -> Any:
        """Plan ``samples`` (``samples[i * world + r]``: rank r's model at step i) for the
        device budget; the returned :class:`~retiarii.strategies.one_shot.split_training.SplitRun`
        gives each step's path (``run.path(step)``) and :meth:`train` averages over it until
        :meth:`end_split`."""
        from .split_training import plan_segment

        self._split = plan_segment(self, [_sample_of(s) for s in samples], ctx)
        return self._split

    def end_split(self) -> None:
        """Every rank gets the whole super-graph back as its host copy (see SplitRun.finish)."""
        run, self._split = self._split, None
        if run is not None:
            run.finish()

    def train_split(self, ctx: Any, rngs: list, batches_per_model: int,
                    draw: Callable[[Any], Any]) -> dict:
        """One segment of single-path training under the device budget: every step's model
        drawn first (``draw(rngs[r])`` for each rank r, in the order a plain loop draws them;
        ``rngs``: each rank's generator or sampler),
        the schedule planned (:meth:`split_segment`), then each rank trains its models on its
        batches (``batches_per_model`` each). Returns the segment's metrics: ``train_loss``,
        ``paths``, ``batches``, ``windows``, ``split`` (0: replicated) and ``held_bytes``
        (the most bytes of shared weights one rank held)."""
        batches = ctx.train_batches()
        batches = batches if hasattr(batches, "__len__") else list(batches)
        steps = -(-len(batches) // batches_per_model)
        samples = [draw(g) for _ in range(steps) for g in rngs]
        run = self.split_segment(samples, ctx)
        losses: list[float] = []
        model = None
        for i, batch in enumerate(batches):
            if ctx.should_stop():
                break
            if i % batches_per_model == 0:
                model = run.path(i // batches_per_model)
            losses.append(self.train(model, batch, ctx))
        self.end_split()
        windows = run.plan.windows
        return {"train_loss": sum(losses) / max(len(losses), 1),
                "paths": -(-len(losses) // batches_per_model), "batches": len(losses),
                "windows": len(windows), "split": int(not run.plan.replicated),
                "held_bytes": max((max(w.bytes) for w in windows), default=0)}

    # -- RNG streams --------------------------------------------------------------------------

    @contextlib.contextmanager
    def own_rng(self):
        """Swaps the strategy's python, numpy and torch streams in for the block."""
        from ...rng import swapped_in

        with swapped_in(self):
            yield

    # -- training and evaluation ----------------------------------------------------------------

    def net(self, sample_or_model: Any) -> nn.Module:
        """The module of one path on the shared weights (with a device budget, its operators
        loaded from the host copies first)."""
        if self.memory is not None and self._split is None:
            from .split_training import ensure

            ensure(self, sample_or_model, self.supergraph.ops_of(sample_or_model))
        return self.supergraph.path(sample_or_model)

    def own_path(self, models: list, ctx: Any) -> Any:
        """``models[ctx.rank]``, after building every rank's path in rank order.

        On several ranks each trains its own path, but :func:`~retiarii.optim.mixed_parallel.
        average_used_gradients` needs the same parameters in the same order on every rank:
        building all K paths everywhere grows every rank's super-graph alike (a new
        operator's initial weights follow from its key, whichever rank asks first).
        """
        if len(models) != ctx.world:
            raise ValueError(f"own_path: {len(models)} paths for {ctx.world} ranks")
        if ctx.world > 1:
            for model in models:
                self.net(model)
        return models[ctx.rank]

    def train(self, sample_or_model: Any, batch: Any, ctx: Any) -> float:
        """One optimizer step of one path on one batch; returns the loss.

        Raises:
            FloatingPointError: the loss is not finite (naming the path).
        """
        from ...training import to_device as _to_device

        net = self.net(sample_or_model)
        net.train()
        loss = self.trainer.training_step(net, _to_device(batch, self.device), self.hparams)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(
                f"the loss of path {_sample_of(sample_or_model)} is {value}; lower the "
                f"learning rate or check the trainer's training_step")
        self.optimizer.zero_grad(set_to_none=True)
        if loss.requires_grad:  # (a path of frozen and parameter-free ops has nothing to train)
            loss.backward()
        if ctx.world > 1 and self._split is not None:
            # a split super-graph: lined up by name, zeros for weights held elsewhere
            from .split_training import average_named_gradients

            average_named_gradients(self._split.layout, self._split.params(), ctx.group,
                                    self.device)
        elif ctx.world > 1:
            # Each rank trained its own path: a shared weight's gradient is the mean over the
            # ranks that used it (mask and count), not over all ranks as DDP would divide.
            # Every rank calls it, even one whose path had nothing to train: it is collective.
            from ...optim.mixed_parallel import average_used_gradients

            average_used_gradients(list(self.supergraph.parameters()), ctx.group)
        self.optimizer.step()
        if self.scheduler is not None and self.interval == "step":
            self.scheduler.step()
        return value

    def end_segment(self) -> None:
        """Steps an epoch-wise LR scheduler (a segment is an epoch)."""
        if self.scheduler is not None and self.interval == "epoch":
            self.scheduler.step()

    def evaluate(self, sample_or_model: Any, batches: Iterable,
                 calibrate: Iterable | None = None) -> dict[str, float]:
        """``validation_step`` metrics of a path averaged over ``batches`` (weighted by batch
        size), with the inherited weights and no training.

        Args:
            calibrate: train batches to recompute the path's BatchNorm statistics on first
                (forward passes in train mode, no gradient); the super-graph's own statistics
                are put back afterwards, so evaluating never changes the shared state.
        """
        from ...training import batch_size as _batch_size
        from ...training import to_device as _to_device

        net = self.net(sample_or_model)
        saved = _bn_state(net) if calibrate is not None else None
        try:
            if calibrate is not None:
                self._recalibrate(net, calibrate)
            net.eval()
            sums: dict[str, float] = {}
            count = 0
            with torch.no_grad():
                for batch in batches:
                    batch = _to_device(batch, self.device)
                    n = _batch_size(batch)
                    for name, value in self.trainer.validation_step(net, batch).items():
                        sums[name] = sums.get(name, 0.0) + float(value) * n
                    count += n
            if count == 0:
                raise ValueError("evaluating a path got no validation batches; check the "
                                 "trainer's val_dataloader (and eval_batches)")
            return {name: total / count for name, total in sums.items()}
        finally:
            if saved is not None:
                _load_bn_state(net, saved)

    def calibrated_state(self, sample_or_model: Any, batches: Iterable) -> dict:
        """The ``state_dict`` of a standalone copy of a path with its inherited weights and
        its BatchNorm statistics recomputed on ``batches`` as :meth:`evaluate` recomputes
        them: the weights a path evaluated with ``calibrate`` was judged with. The shared
        weights and the RNG streams are left as they were."""
        self.net(sample_or_model)  # (under a device budget: its operators loaded first)
        net = self.supergraph.export(sample_or_model)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda"
                                   else []):
            self._recalibrate(net, batches)
        return {k: v.detach().clone() for k, v in net.state_dict().items()}

    def _recalibrate(self, net: nn.Module, batches: Iterable) -> None:
        from ...training import to_device as _to_device

        bns = [m for m in net.modules() if isinstance(m, _BN) and m.track_running_stats]
        if not bns:
            return
        momenta = [m.momentum for m in bns]
        for m in bns:
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the calibration batches
        net.train()
        try:
            with torch.no_grad():
                for batch in batches:
                    # The trainer's own forward (its loss) is the one way to feed any batch
                    # format to the net; the loss itself is dropped.
                    self.trainer.training_step(net, _to_device(batch, self.device), self.hparams)
        finally:
            for m, momentum in zip(bns, momenta):
                m.momentum = momentum

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        from ... import rng as ckpt

        from ...optim.keyed_state import keyed_optimizer_state
        from .split_training import full_state

        if self.memory is not None:  # the pool, parked copies and the unit together
            supergraph, optimizer = full_state(self)
        else:
            supergraph = self.supergraph.state_dict()
            optimizer = keyed_optimizer_state(self.optimizer,
                                              dict(self.supergraph.named_parameters()))
        return {
            "supergraph": supergraph,
            "optimizer": optimizer,
            "lr_scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "rng": ckpt.portable_rng(self._rng),
        }

    def load_state_dict(self, state: dict) -> None:
        from ... import rng as ckpt

        from ...optim.keyed_state import is_keyed, load_keyed_optimizer_state
        from .split_training import load_unit

        if self.memory is not None:  # a device budget: operators load as they are needed
            load_unit(self, state)
        else:
            self.supergraph.load_state_dict(state["supergraph"])
            if is_keyed(state["optimizer"]):
                load_keyed_optimizer_state(self.optimizer,
                                           dict(self.supergraph.named_parameters()),
                                           state["optimizer"])
            else:  # (units saved before the keyed format: by position)
                self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["lr_scheduler"] is not None:
            self.scheduler.load_state_dict(state["lr_scheduler"])
        self._rng = ckpt.native_from_portable(state["rng"])


def _sample_of(sample_or_model: Any) -> dict:
    return dict(getattr(sample_or_model, "sample", sample_or_model))


def _bn_state(net: nn.Module) -> list[tuple[nn.Module, dict[str, torch.Tensor]]]:
    return [(m, {k: v.clone() for k, v in m.state_dict().items()})
            for m in net.modules() if isinstance(m, _BN) and m.track_running_stats]


def _load_bn_state(net: nn.Module, saved: list) -> None:
    for m, state in saved:
        m.load_state_dict(state)
