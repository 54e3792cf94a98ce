"""Mixed parallelism (paper §5.2, Fig. 10): a weight-sharing super-graph trained on K ranks,
each rank a *different* sampled model on *different* data, shared weights kept equal.

Data parallelism (DDP) trains one model on K shards of a batch and divides the summed gradient
by K. Here the K ranks train K different paths of one super-graph, so a shared weight is used
by some ranks only: its gradient is the average over **the ranks that used it** in this step
(mask and count), not the sum divided by K (a weight used by one rank of three would get a
third of its gradient). A weight no rank used keeps ``grad = None`` on every rank, so the optimizer
skips it everywhere and the ranks' weights and optimizer states stay identical. BatchNorm
running statistics stay per rank: each rank normalizes its own model's batch, so no SyncBN
(its synchronization in every BN layer is what makes data parallelism slow, paper §7.4).

What runs on each rank lives here; the launchers of ranks live with the executors:
:func:`~retiarii.engine.executors.local_ranks.spawn` (K local processes) and
:func:`~retiarii.engine.executors.local_ranks.run_segment_on_ranks` (a segment of a one-shot
strategy on them), :func:`~retiarii.engine.executors.ray_ranks.run_segment_on_actors` (on Ray).

* :func:`average_used_gradients` after each rank's ``backward``, before ``optimizer.step()``;
* :func:`segment_rank` is one rank's part of a segment of a :class:`~retiarii.strategies.
  one_shot.OneShot` strategy, and :func:`gather_segment` puts the K ranks' parts together.

Example::

    def train(rank, world, group, steps):
        torch.manual_seed(0)                      # the same initial weights on every rank
        net, opt = SuperNet(), torch.optim.SGD(...)
        for step in range(steps):
            paths = sample_paths(step, world)     # the same K paths drawn on every rank
            x, y = batch(step * world + rank)     # rank r's own batch
            opt.zero_grad(set_to_none=True)       # None marks "not used in this step"
            F.cross_entropy(net(x, paths[rank]), y).backward()
            average_used_gradients(net.parameters(), group)
            opt.step()
        return net.state_dict()

    states = local_ranks.spawn(train, 2, 100)     # [rank 0's, rank 1's]
"""
from __future__ import annotations

import dataclasses
import itertools
import zlib
from collections import defaultdict
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from ..moved import package_getattr

__all__ = ["average_used_gradients", "gather_segment", "limit_memory", "segment_rank",
           "size_buckets"]

# 25 MiB of float32 per all-reduce, as DDP's default bucket: large enough that the per-call
# latency does not dominate, small enough that a huge super-graph does not need one more copy
# of all its gradients at once (one bucket's buffer exists at a time).
BUCKET_ELEMENTS = 25 * 2 ** 20 // 4

# The launcher (spawn, run_segment_on_ranks, RankError, ...) moved to engine/executors/
# local_ranks.py; its old names here answer with it, imported on first use (retiarii/moved.py).
__getattr__ = package_getattr(__name__)


# ---- gradients ---------------------------------------------------------------------------


def average_used_gradients(params: Iterable[torch.nn.Parameter], group: Any = None, *,
                           bucket_elements: int = BUCKET_ELEMENTS) -> torch.Tensor:
    """Average each parameter's gradient over the ranks that used it in this step.

    Call it on every rank of ``group`` after ``backward`` and before ``optimizer.step()``, with
    the same parameters in the same order everywhere (the super-graph's ``parameters()``;
    checked, one small all-gather: a ``ValueError`` on every rank otherwise). A
    parameter is *used* on a rank when its ``grad`` is not None, so clear gradients with
    ``zero_grad(set_to_none=True)`` (PyTorch's default) before each step. Afterwards, on every
    rank, a parameter used by ``c > 0`` ranks holds the sum of their gradients divided by ``c``
    and one used by none holds ``grad = None``. The gradients and use flags travel flattened,
    one all-reduce per bucket of at most ``bucket_elements`` gradient elements (of one dtype and
    device; a larger parameter is a bucket of its own), not one per parameter.

    Example::

        loss.backward()
        counts = average_used_gradients(supernet.parameters(), group)   # (P,) int64
        optimizer.step()

    Args:
        params: the shared parameters, identical in number, shapes and order on every rank.
        group: a ``torch.distributed`` process group; None is the default (world) group.
        bucket_elements: the most gradient elements per all-reduce call.

    Returns:
        How many ranks used each parameter, an int64 tensor on the CPU in ``params`` order.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("average_used_gradients needs a torch.distributed process group: run "
                           "it on the ranks that retiarii.optim.spawn (or torchrun) started")
    if bucket_elements < 1:
        raise ValueError(f"bucket_elements must be >= 1, got {bucket_elements}")
    params = list(params)
    _check_same_parameters(params, group)
    for i, p in enumerate(params):
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) has a sparse gradient; "
                             "average_used_gradients needs dense ones (nn.Embedding(sparse=False))")
    counts = torch.zeros(len(params), dtype=torch.int64)
    # One flat buffer per (device, dtype): NCCL wants tensors on the rank's GPU, and a float16
    # gradient must not be summed in a float32 buffer of another parameter's making.
    kinds: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        kinds[(p.device, p.dtype)].append(i)
    for (device, dtype), members in sorted(kinds.items(), key=lambda kv: (str(kv[0][0]),
                                                                          str(kv[0][1]))):
        for bucket in size_buckets(members, [params[i].numel() for i in members], bucket_elements):
            _reduce_bucket([params[i] for i in bucket], dtype, device, group, counts, bucket)
    return counts


def size_buckets(members: list[int], sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive members, at most ``limit`` elements per bucket (a larger one alone)."""
    out: list[list[int]] = []
    total = limit
    for i, n in zip(members, sizes):
        if total + n > limit:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out


def _reduce_bucket(params: list, dtype: torch.dtype, device: torch.device, group: Any,
                   counts: torch.Tensor, index: list[int]) -> None:
    """One all-reduce for ``params`` (one dtype and device): their gradients, then one use
    flag each, in one buffer; each sum divided by its count, or None where no rank used it."""
    sizes = [p.numel() for p in params]
    flat = torch.zeros(sum(sizes) + len(params), dtype=dtype, device=device)
    grads = flat[:sum(sizes)].split(sizes)  # views: (numel,) per parameter
    for g, p in zip(grads, params):
        if p.grad is not None:
            g.copy_(p.grad.reshape(-1))
    # A count up to the world size is exact in a float dtype (in bfloat16 up to 256 ranks).
    flat[sum(sizes):].copy_(torch.tensor([p.grad is not None for p in params], dtype=dtype))
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    used = flat[sum(sizes):].round().to(torch.int64).cpu().tolist()
    for g, p, c, i in zip(grads, params, used, index):
        counts[i] = c
        if c == 0:
            p.grad = None
        elif p.grad is None:
            p.grad = g.view_as(p).div(c)
        else:
            p.grad.copy_(g.view_as(p)).div_(c)


def _check_same_parameters(params: list, group: Any) -> None:
    """Every rank passes the same parameters (count, sizes, shapes and dtypes in order), or a
    clear error on every rank: different lists would make the flat all-reduces disagree in size
    (a hang or a crash in the backend) or, worse, add up unrelated gradients. One small
    collective."""
    shapes = [(tuple(p.shape), str(p.dtype)) for p in params]
    mine = torch.tensor([len(params), sum(p.numel() for p in params),
                         zlib.crc32(repr(shapes).encode())], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":  # NCCL moves CUDA tensors only
        mine = mine.cuda()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    every = [t.tolist() for t in every]
    if any(t != every[0] for t in every):
        seen = ", ".join(f"rank {r}: {n} parameters, {e} elements" for r, (n, e, _) in
                         enumerate(every))
        raise ValueError(f"average_used_gradients got different parameters on different ranks "
                         f"({seen}; or the same sizes in other shapes, dtypes or order): pass the same "
                         "parameters in the same order everywhere; a SuperGraph that grows as "
                         "paths are built must build every rank's path on every rank, in the "
                         "same order")


# ---- a segment of a one-shot strategy on K ranks -------------------------------------------


class _Share:
    """Rank r's share of the training batches: batches r, r + K, r + 2K, ... of each pass,
    ending where every rank has had as many (the last ``len % K`` batches are left out: a rank
    with one more step than the others would wait for them in its all-reduce)."""

    def __init__(self, data: Iterable, rank: int, world: int):
        # A DataLoader has a length; a generator is read once, here.
        self.data = data if hasattr(data, "__len__") else list(data)
        self.rank, self.world = rank, world

    def __iter__(self) -> Iterator:
        stop = len(self.data) // self.world * self.world
        return itertools.islice(iter(self.data), self.rank, stop, self.world)

    def __len__(self) -> int:
        return len(self.data) // self.world


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)((k, _to_cpu(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_cpu(v) for v in value)
    return value


def segment_rank(rank: int, world: int, group: Any, build: Callable, state: dict | None):
    """One rank's part of a segment on ranks (what every launcher of ranks runs:
    :func:`~retiarii.engine.executors.local_ranks.run_segment_on_ranks`,
    :func:`~retiarii.engine.executors.ray_ranks.run_segment_on_actors`): rank 0 returns
    ``(result, state on the CPU)``, the others their evaluated models; :func:`gather_segment`
    puts the K outcomes, in rank order, together."""
    strategy, ctx = build()
    if ctx.device_memory is not None:  # hold part of the super-graph (before loading it all)
        limit_memory(strategy, ctx.device_memory)
    if state is not None:
        strategy.load_state_dict(state)
    ctx.rank, ctx.world, ctx.group = rank, world, group
    ctx.train = _Share(ctx.train_batches(), rank, world)
    result = strategy.run_segment(ctx)
    if rank == 0:
        return result, _to_cpu(strategy.state_dict())
    return list(result.models)


def limit_memory(strategy: Any, memory: float) -> None:
    """Give a one-shot strategy a device budget for its shared weights (its
    ``limit_memory``), or a clear error when it cannot split its super-graph."""
    limit = getattr(strategy, "limit_memory", None)
    if not callable(limit):
        raise ValueError(f"device_memory: {type(strategy).__name__} cannot split its shared "
                         "weights over devices (SPOS, ENAS and WeightSharing can); leave device_memory unset")
    limit(memory)


def gather_segment(outcomes: list) -> tuple[Any, dict]:
    """``(result, state)`` of a segment from its ranks' :func:`segment_rank` outcomes in rank
    order: rank 0's result with every rank's models (rank 0's first), and rank 0's state."""
    result, new_state = outcomes[0]
    models = list(result.models) + [m for ranked in outcomes[1:] for m in ranked]
    return dataclasses.replace(result, models=models), new_state
