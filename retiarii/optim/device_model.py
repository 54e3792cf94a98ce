"""A deterministic model of a device: decides the layouts that change a model's values.

Fusing K models (one batched matmul where each model ran its own) or batching a frozen layer
over K models' concatenated inputs computes each model's values with other kernels, so with
other float rounding, and which kernel a fused call picks depends on its companions too
(measured on this CPU: a batched matmul's slice differs from the same matmul alone, and from
the same slice among other companions). A search whose fusion were chosen by wall-clock time
would then give other results on a busier machine. So the default (``fuse="auto"``,
``batching="auto"``) decides these layouts here, from the models' shapes and a fixed model
of the kind of device, never from a measurement; time may choose only between layouts that
are bit-identical (a model apart or in a CSE group). ``"measure"`` keeps the decision by
measurement (faster where the model is wrong; not reproducible).

The model (constants per kind of device, measured once on the project's machines with
``benchmarks/fusion.py``: benchmarks/README.md, "The device model"). One training step of a
model of ``n`` operations whose layers compute ``F`` FLOPs forward costs alone::

    n * OP_S  +  MODEL_S  +  3 F / RATE                      (3: forward, two backward products)

and K such models fused, one call per operation (``d`` weightless operations that differ
between the models' architectures, an activation, run once per distinct operation; a layer
with weights that differs, another operator at one place, runs per model as it does alone,
``own``, plus two calls per model for each place it differs at: a run of its own layers)::

    (n + d) * FUSED_OP_S  +  K * FUSED_MODEL_S  +  3 K F / FUSED_RATE  +  own

A CPU's batched matmul computes at a lower rate than its single matmul on large matrices, so
wide layers lose when fused (16 MLPs of width 512 predicted 0.95x) and narrow ones win (width
64: 2.5x measured); a GPU's per-kernel cost dominates small models and fusion wins there.
Fusion is taken at or over :data:`FUSE_MARGIN`. Frozen layers count K times when fused and
once apart (CSE computes a frozen part once for the group), and so do the operations before a
model's first trainable layer: apart, a CSE group runs a frozen trunk's ``s`` operations once
(``s * OP_S``), where fused runs them as K-model kernels. Counting them K times apart had
predicted 8 heads on a frozen ResNet-18 trunk to gain several-fold fused on an H200, where they
measured 0.29x of CSE (benchmarks/README.md, "GPU figures (wave 3)").

Example::

    costs = step_costs(model, batch_inputs)        # 2 examples, no grad: nothing moves
    predicted_fused_speedup([costs] * 16, "cpu")   # e.g. 2.4
"""
from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

__all__ = ["BATCH_CPU_CALL_FLOPS", "CSE_GROUP_COST", "PROBE_EXAMPLES", "CSE_MARGIN", "CSE_TAKE", "DEVICES",
           "DeviceModel", "FUSE_MARGIN", "StepCosts", "cse_bound", "cse_floor", "fuses_places",
           "batching_wins", "predicted_fused_speedup", "step_costs"]


@dataclass(frozen=True)
class DeviceModel:
    """The constants of one kind of device (seconds, FLOP/s per thread on a CPU)."""

    op_s: float          # one operation alone, forward and backward
    model_s: float       # per model and step alone: its loss, its optimizer, its step
    rate: float          # FLOP/s of one model's layers alone
    fused_op_s: float    # one fused operation (K models), forward and backward
    fused_model_s: float  # per model and step in a fused unit: its loss, its proxy
    fused_rate: float    # FLOP/s of the fused layers
    # whether models that differ at places with weights (per-model layers on slices of the
    # fused batch) may be predicted to gain: not on a CPU, where workload (d)'s MnasNet-like
    # space measured 0.70-0.79x fused in whole searches (benchmarks/README.md) and no such
    # family was measured faster
    fuses_places: bool = True


# Fitted to benchmarks/fusion.py's MLPs (64-W-W-10, Adam, batch 128, one thread) at widths
# 32-512 on the project's 2-core CPU (benchmarks/README.md, "The device model"); the GPU's
# from the H100 figures of the same benchmark (16 MLPs 6.45x, 16 small CNNs 7.54x).
DEVICES = {
    "cpu": DeviceModel(op_s=0.12e-3, model_s=0.45e-3, rate=45e9,
                       fused_op_s=0.2e-3, fused_model_s=0.33e-3, fused_rate=40e9,
                       fuses_places=False),
    "cuda": DeviceModel(op_s=30e-6, model_s=0.3e-3, rate=30e12,
                        fused_op_s=40e-6, fused_model_s=0.1e-3, fused_rate=30e12),
}
FUSE_MARGIN = 1.2
# A group whose CSE could gain at most this over training its models apart (cse_bound) trains
# apart without measuring: a grouped step's own cost (the group's forward, the merged
# backward) is about this much of a small model's step on a CPU (the demo's first job
# measured CSE at 0.86-0.87x of apart: benchmarks/README.md)
CSE_MARGIN = 1.1
# What grouping adds to a CSE group's step, per model, in units of a model's fixed cost per
# step (MODEL_S): its streams switched, its loss in the merged backward, its part of the
# group's forward. A cost per model, not per operation: fitted so that the demo's 8 small
# models sharing nothing get the 0.87x of apart that their CSE measured (benchmarks/README.md:
# about 1.2 ms a model on a CPU), where workload (b)'s adapters (about 170 operations a model)
# gained within a few percent of their bound.
CSE_GROUP_COST = 2.6
# A default group whose CSE gains at least this (cse_floor) takes CSE without measuring.
CSE_TAKE = 1.25
# Operator batching on a CPU computes the same FLOPs as CSE alone (a convolution over K x B
# examples costs K of B); it saves each batched call's fixed work (K - 1 dispatches, forward
# and backward, and small kernels' poor use of the cores) and pays the concatenations. So it
# wins where a frozen call does little arithmetic per model: measured (benchmarks/README.md,
# "Operator batching" and "bfreeze"): MobileNetV2 0.25 at 32 px, 0.95 / 1.9 / 3.8 MFLOP per
# call and model (16 / 32 / 64 examples), faster than CSE alone by 1.87x / 1.96x / 1.72x; the
# 3x3 CNN of benchmarks/batching.py, 17 MFLOP (4 examples) 1.13x, 136 MFLOP (32) 0.79-0.86x:
# break-even near 39 MFLOP by log interpolation of the CNN's two points, taken a little below.
BATCH_CPU_CALL_FLOPS = 32e6


@dataclass(frozen=True)
class StepCosts:
    """What the device model reads of one model on one batch: its operations, the FLOPs of
    its trainable and frozen layers (forward, one batch) and the names of its operations in
    order (a layer with weights with its configuration: to find those that differ between
    architectures), with each operation's trainable FLOPs (``op_flops``, parallel to
    ``ops``)."""

    ops: tuple[str, ...]
    flops: float
    frozen_flops: float
    op_flops: tuple[float, ...] = ()
    frozen_calls: int = 0  # calls of frozen layers with weights in one forward
    # the leading operations (in execution order) before the first one with weights that
    # train, up to the last frozen layer with weights among them: each depends on the batch
    # and frozen values only, so CSE runs it once for a group whose models hold it alike (a
    # frozen trunk's every layer, norm and activation)
    shared_ops: int = 0
    # each operation's frozen FLOPs (forward, one batch; parallel to ``ops``): what a CSE
    # group computes once where models hold the operation alike in their shared prefixes
    op_frozen: tuple[float, ...] = ()

    @property
    def frozen_flops_per_call(self) -> float:
        """The mean forward FLOPs of one call of a frozen layer with weights (0 without)."""
        return self.frozen_flops / self.frozen_calls if self.frozen_calls else 0.0


def _op(name: str, m: nn.Module) -> str:
    """A layer's operation: its name and type, and a layer with weights its configuration."""
    weighted = any(True for _ in m.parameters(recurse=False))
    return f"{name}:{type(m).__name__}" + (f"({m.extra_repr()})" if weighted else "")


def _ops(module: nn.Module, prefix: str = "") -> tuple[tuple[str, str], ...]:
    """(operation, module path or "") of what a generated model runs, in order (nested
    generated cells flattened); a module that is not an ``fx.GraphModule`` counts as its
    leaf modules."""
    if isinstance(module, fx.GraphModule):
        out: list[tuple[str, str]] = []
        for node in module.graph.nodes:
            if node.op == "call_module":
                sub = module.get_submodule(node.target)
                out.extend(_ops(sub, f"{prefix}{node.target}.") if isinstance(
                    sub, fx.GraphModule) else ((_op(node.target, sub), prefix + node.target),))
            elif node.op in ("call_function", "call_method"):
                out.append((f"{node.name}:{getattr(node.target, '__name__', node.target)}", ""))
        return tuple(out)
    return tuple((_op(n, m), prefix + n) for n, m in module.named_modules()
                 if not list(m.children()))


def _layer_flops(module: nn.Module, out: Any) -> float:
    """Forward FLOPs of a layer with weights from its output's shape (multiply-adds x 2)."""
    if not isinstance(out, torch.Tensor):
        return 0.0
    if isinstance(module, nn.Linear):
        return 2.0 * out.numel() * module.in_features
    if isinstance(module, nn.modules.conv._ConvNd):
        per = module.weight[0].numel() if not module.transposed else \
            module.weight.shape[1] * module.weight[0, 0].numel()
        return 2.0 * out.numel() * per
    return 5.0 * out.numel()  # a norm, an embedding: a few element-wise operations


# Examples a probe forward runs (a train-mode BatchNorm needs two); its FLOPs are scaled to
# the batch.
PROBE_EXAMPLES = 2


def _hooked_forward(module: nn.Module, inputs: Sequence[Any], scale: float) -> tuple:
    """One forward of ``module`` on ``inputs`` under ``no_grad``, each layer with weights
    counted (its FLOPs times ``scale``): (trainable FLOPs, frozen FLOPs, frozen calls,
    trainable FLOPs by module path, frozen FLOPs by module path)."""
    trainable, frozen, frozen_calls = [0.0], [0.0], [0]
    by_path: dict[str, float] = {}
    frozen_by_path: dict[str, float] = {}

    def hook(layer, _args, out, path=""):
        params = list(layer.parameters(recurse=False))
        if params:
            flops = _layer_flops(layer, out) * scale
            if any(p.requires_grad for p in params):
                trainable[0] += flops
                by_path[path] = by_path.get(path, 0.0) + flops
            else:
                frozen[0] += flops
                frozen_calls[0] += 1
                frozen_by_path[path] = frozen_by_path.get(path, 0.0) + flops
    handles = [m.register_forward_hook(lambda mod, a, o, path=name: hook(mod, a, o, path))
               for name, m in module.named_modules()
               if any(True for _ in m.parameters(recurse=False))]
    try:
        with torch.no_grad():
            module(*inputs)
    finally:
        for h in handles:
            h.remove()
    return trainable[0], frozen[0], frozen_calls[0], by_path, frozen_by_path


def _shadow(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s module tree for a probe forward, sharing the parameters (read
    only, under ``no_grad``): new module objects whose attribute dictionaries, and the
    containers and tensors in them, are their own (buffers cloned, a buffer tied between
    modules cloned once), so a running statistic, a call counter or a cache a forward sets
    lands on the copy, never on the trial's model. Unlike ``copy.deepcopy`` it regenerates
    no ``fx.GraphModule`` code (a new instance of the same generated class): about 7 ms
    against 17 ms for a MobileNetV2 on this CPU. Falls back to ``deepcopy`` (parameters
    shared, buffers cloned) for a module it cannot copy so."""
    made: dict[int, nn.Module] = {}
    tensors: dict[int, torch.Tensor] = {id(p): p for p in model.parameters()}

    def tensor(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in tensors:
            tensors[id(t)] = t.detach().clone()
        return tensors[id(t)]

    def value(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return tensor(v)
        if isinstance(v, (dict, list, set)):  # hooks, caches, counters' containers
            return copy.copy(v)
        return v

    def one(m: nn.Module) -> nn.Module:
        if id(m) in made:
            return made[id(m)]
        new = object.__new__(type(m))
        made[id(m)] = new
        state = {k: value(v) for k, v in vars(m).items()
                 if k not in ("_parameters", "_buffers", "_modules")}
        state["_parameters"] = dict(m._parameters)
        state["_buffers"] = {k: None if b is None else tensor(b) for k, b in m._buffers.items()}
        state["_modules"] = {k: None if c is None else one(c) for k, c in m._modules.items()}
        new.__dict__.update(state)
        return new

    try:
        return one(model)
    except Exception:  # noqa: BLE001 (a module without the usual attributes: the slow copy)
        memo: dict[int, Any] = {id(p): p for p in model.parameters()}
        memo.update({id(b): tensor(b) for b in model.buffers()})
        return copy.deepcopy(model, memo)


def _probe_forward(model: nn.Module, inputs: Sequence[Any]) -> tuple | None:
    """:func:`_hooked_forward` of the real model on the first :data:`PROBE_EXAMPLES`
    examples (zeros of their shape where ``inputs`` are meta tensors), scaled to the batch,
    on a copy of the model's modules (its parameters shared), the random streams put back;
    None when the inputs' first dimensions are not one batch size, or the model is on the
    meta device."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if not tensors or any(x.dim() == 0 or x.shape[0] != tensors[0].shape[0] for x in tensors):
        return None
    batch = tensors[0].shape[0]
    small = min(batch, PROBE_EXAMPLES)
    if small < 1 or any(p.device.type == "meta" for p in model.parameters()):
        return None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    # a meta input (what the worker records of a batch: its shapes) becomes zeros on the
    # model's device: FLOPs depend on shapes alone, and zeros index any embedding
    cut = [(torch.zeros((small, *x.shape[1:]), dtype=x.dtype, device=device)
            if x.device.type == "meta" else x[:small]) if isinstance(x, torch.Tensor) else x
           for x in inputs]
    shadow = _shadow(model)
    gpus = sorted({t.device.index or 0 for t in [*tensors, *model.parameters()]
                   if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=gpus):
        return _hooked_forward(shadow, cut, batch / small)


def step_costs(model: nn.Module, inputs: Sequence[Any]) -> StepCosts:
    """The :class:`StepCosts` of ``model`` on a batch shaped like ``inputs``, from one
    forward under ``no_grad`` on :data:`PROBE_EXAMPLES` examples of the batch, its FLOPs
    scaled to the batch, on a copy of the module tree that shares the parameters, the
    random streams restored after it: nothing of the model moves. Where that forward cannot
    run (inputs whose first dimension is not the batch, a model that needs the whole batch),
    on **meta** tensors: a copy whose parameters are shapes only, nothing computed (several
    times slower: 140-400 ms for a MobileNetV2 on this CPU, against 35 ms)."""
    try:
        found = _probe_forward(model, inputs)
    except Exception:  # noqa: BLE001 (whatever a small batch breaks: the meta forward)
        found = None
    if found is None:
        memo: dict[int, Any] = {}
        for t in list(model.parameters()) + list(model.buffers()):
            memo[id(t)] = (nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad)
                           if isinstance(t, nn.Parameter) else torch.empty_like(t, device="meta"))
        shadow = copy.deepcopy(model, memo)
        meta = [torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x
                for x in inputs]
        found = _hooked_forward(shadow, meta, 1.0)
    trainable, frozen, frozen_calls, by_path, frozen_by_path = found
    ops = _ops(model)
    shared = 0
    for i, (_, path) in enumerate(ops):
        params = list(model.get_submodule(path).parameters()) if path else []
        if any(p.requires_grad for p in params):
            break
        if params:  # up to the last frozen layer with weights: a prefix of glue alone (a
            shared = i + 1  # flatten of the input) saves nothing worth a group
    return StepCosts(tuple(o for o, _ in ops), trainable, frozen,
                     tuple(by_path.get(path, 0.0) if path else 0.0 for _, path in ops),
                     frozen_calls, shared,
                     tuple(frozen_by_path.get(path, 0.0) if path else 0.0 for _, path in ops))


def _device(device: Any) -> tuple[DeviceModel, float]:
    kind = torch.device(device).type if not isinstance(device, str) or ":" in device or \
        device in ("cpu", "cuda") else device
    model = DEVICES.get(kind, DEVICES["cpu"])
    threads = torch.get_num_threads() if kind == "cpu" else 1
    return model, max(1, threads) ** 0.8  # two threads are not twice one on small matrices


def predicted_fused_speedup(costs: Sequence[StepCosts], device: Any = "cpu") -> float:
    """The predicted speed-up of training the models of ``costs`` fused over training them
    apart (their frozen layers once: what CSE gives), on ``device`` (a torch device or its
    kind). Deterministic: the same costs give the same figure on every run."""
    dev, threads = _device(device)
    k = len(costs)
    if k < 2:
        return 1.0
    rate, fused_rate = dev.rate * threads, dev.fused_rate * threads
    shared = _shared_prefix(costs)
    apart = sum((len(c.ops) - shared) * dev.op_s + dev.model_s + 3 * c.flops / rate
                for c in costs)
    # the frozen part once, forward only, and the operations every model holds before its
    # first trainable one once (CSE's group runs them for all)
    apart += costs[0].frozen_flops / rate + shared * dev.op_s
    # The operations every model holds fuse (one call each); a weightless one that differs
    # (an activation) runs once per distinct one; a layer with weights that differs (another
    # operator at one place) runs per model as alone, plus its place's gather and scatter.
    common = Counter(costs[0].ops)
    for c in costs[1:]:
        common &= Counter(c.ops)
    weightless: set[str] = set()
    own_s, own_flops, places = 0.0, 0.0, 0
    for c in costs:
        left = Counter(common)
        flops = c.op_flops or (0.0,) * len(c.ops)
        own = [not _take(left, op) for op in c.ops]  # in execution order
        mine = [(op, f) for (op, f), o in zip(zip(c.ops, flops), own) if o]
        weighted = [(op, f) for op, f in mine if f > 0]
        weightless |= {op for op, f in mine if f <= 0}
        own_s += len(weighted) * dev.op_s + 3 * sum(f for _, f in weighted) / rate
        own_flops += sum(f for _, f in weighted)
        places += _places(own, flops)
    fused = ((sum(common.values()) + len(weightless) + 2 * places) * dev.fused_op_s
             + k * dev.fused_model_s + own_s
             + (sum(3 * c.flops + c.frozen_flops for c in costs) - 3 * own_flops) / fused_rate)
    if places and not dev.fuses_places:
        return min(apart / fused, 1.0)
    return apart / fused


def cse_bound(costs: Sequence[StepCosts], loader_s: float = 0.0, device: Any = "cpu") -> float:
    """The most a CSE group of the models of ``costs`` can gain over training them apart on
    ``device``: the frozen layers and operations their prefixes hold alike computed once
    (:func:`_cse_saving`) and one loader for all (``loader_s``: seconds the loader takes per
    batch, each model apart paying it), with nothing paid for grouping. Under
    :data:`CSE_MARGIN` a group cannot win, whatever a measurement would say. Deterministic,
    as :func:`predicted_fused_speedup`.

    Example::

        cse_bound([step_costs(m, [x]) for m in models], loader_s=0.0)   # nothing frozen: 1.0
    """
    return _cse_ratio(costs, loader_s, device, 0.0)


def cse_floor(costs: Sequence[StepCosts], loader_s: float = 0.0, device: Any = "cpu") -> float:
    """The least a CSE group of the models of ``costs`` gains over training them apart on
    ``device``: :func:`cse_bound`'s savings against a grouped step that costs
    :data:`CSE_GROUP_COST` times a model's fixed step cost (``MODEL_S``) more per model. At
    or over :data:`CSE_TAKE` a default group takes its merged layout without measuring: CSE
    and apart give the same values bit for bit, so only time is at stake. Deterministic for
    the same ``loader_s``.

    Example::

        cse_floor([step_costs(m, [x]) for m in heads_on_a_frozen_trunk])   # e.g. 3.8
    """
    return _cse_ratio(costs, loader_s, device, CSE_GROUP_COST)


def _cse_ratio(costs: Sequence[StepCosts], loader_s: float, device: Any,
               group_cost: float) -> float:
    """Apart's step over a CSE group's, the group paying ``group_cost`` x MODEL_S a model."""
    dev, threads = _device(device)
    if len(costs) < 2:
        return 1.0
    rate = dev.rate * threads
    alone = sum(len(c.ops) * dev.op_s + dev.model_s + (3 * c.flops + c.frozen_flops) / rate
                for c in costs)
    loader_s = max(float(loader_s), 0.0)
    grouped = (alone + len(costs) * group_cost * dev.model_s
               - _cse_saving(costs, dev, rate) + loader_s)
    return (alone + len(costs) * loader_s) / max(grouped, 1e-12)


def _cse_saving(costs: Sequence[StepCosts], dev: DeviceModel, rate: float) -> float:
    """Seconds a CSE group's step saves over its models apart: each model's shared prefix
    (:attr:`StepCosts.shared_ops`) as a path in a trie of operations, every node of the trie
    computed once (its call and its frozen FLOPs, forward) where apart each model computes
    its own path. Models whose prefixes hold the same trunk save it K - 1 times; adapters
    after different blocks of one backbone save each block as often as models pass it, less
    once. Models without :attr:`StepCosts.op_frozen` (made by hand) count
    ``frozen_flops`` on the common prefix of all."""
    if any(len(c.op_frozen) != len(c.ops) for c in costs):
        return (len(costs) - 1) * (min(c.frozen_flops for c in costs) / rate
                                   + _shared_prefix(costs) * dev.op_s)
    root: dict = {}
    alone_s = trie_s = 0.0
    for c in costs:
        node = root
        for op, flops in zip(c.ops[:c.shared_ops], c.op_frozen[:c.shared_ops]):
            cost = dev.op_s + flops / rate
            alone_s += cost
            if op not in node:
                node[op] = {}
                trie_s += cost
            node = node[op]
    return alone_s - trie_s


def _shared_prefix(costs: Sequence[StepCosts]) -> int:
    """How many leading operations every model of ``costs`` holds alike before its first
    trainable one (:attr:`StepCosts.shared_ops`): what a CSE group runs once."""
    limit = min(c.shared_ops for c in costs)
    count = 0
    for ops in zip(*(c.ops[:limit] for c in costs)):
        if any(op != ops[0] for op in ops[1:]):
            break
        count += 1
    return count


def _places(own: Sequence[bool], flops: Sequence[float]) -> int:
    """How many places a model differs at: runs of consecutive operations of its own (not
    held by every model) that hold a layer with weights; each costs a gather and a scatter
    per model (a MnasNet-like space differs at every block: measured 0.79x fused on a CPU
    where one place per model predicted 1.41x, benchmarks/README.md)."""
    count, run_weighted, inside = 0, False, False
    for mine, f in zip(list(own) + [False], list(flops) + [0.0]):
        if mine:
            inside, run_weighted = True, run_weighted or f > 0
        elif inside:
            count, inside, run_weighted = count + run_weighted, False, False
    return count


def fuses_places(device: Any) -> bool:
    """Whether the device model may predict a gain for models that differ at places with
    weights on ``device`` (see :class:`DeviceModel`)."""
    return _device(device)[0].fuses_places


def _take(left: Counter, op: str) -> bool:
    """Count ``op`` off ``left`` (the operations every model holds); whether it was there."""
    if left[op] > 0:
        left[op] -= 1
        return True
    return False


def batching_wins(costs: Sequence[StepCosts], device: Any = "cpu") -> bool:
    """Whether operator batching is taken under ``batching="auto"`` for the models of
    ``costs``: on a GPU always (one kernel for N small batches); on a CPU when their frozen
    layers with weights do at most :data:`BATCH_CPU_CALL_FLOPS` forward FLOPs per call and
    model on average (a call's fixed work then weighs more than the concatenations batching
    pays). Deterministic: shapes decide, never a clock.

    Example::

        batching_wins([step_costs(m, [x]) for m in models], "cpu")   # MobileNetV2 0.25: True
    """
    kind = torch.device(device).type if not isinstance(device, str) else device.split(":")[0]
    if kind != "cpu":
        return True
    per_call = [c.frozen_flops_per_call for c in costs if c.frozen_calls]
    return bool(per_call) and sum(per_call) / len(per_call) <= BATCH_CPU_CALL_FLOPS
