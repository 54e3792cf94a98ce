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

Three pieces, from the inside out:

* :func:`average_used_gradients` after each rank's ``backward``, before ``optimizer.step()``;
* :func:`spawn` runs a function on K local processes that form a ``torch.distributed`` group;
* :func:`run_segment_on_ranks` runs one segment of a :class:`~retiarii.strategies.one_shot.
  OneShot` strategy on K ranks: what the engine calls for a mixed-parallel job.

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

    states = spawn(train, 2, 100)                 # [rank 0's, rank 1's]
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import socket
import threading
import time
import traceback
import zlib
from collections import defaultdict
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from ..determinism import carry

__all__ = ["RankError", "average_used_gradients", "gather_segment", "loopback_interface",
           "run_segment_on_ranks", "segment_rank", "spawn"]

# 25 MiB of float32 per all-reduce, as DDP's default bucket: large enough that the per-call
# latency does not dominate, small enough that a huge super-graph does not need one more copy
# of all its gradients at once (one bucket's buffer exists at a time).
BUCKET_ELEMENTS = 25 * 2 ** 20 // 4

# How long a process group waits in a collective when spawn() is given no timeout: DDP's own
# default. A rank that fails makes spawn() stop the others at once, so this matters only for
# ranks that hang without failing.
DEFAULT_TIMEOUT = 1800.0

# After terminate(), how long a rank gets to exit before it is killed.
_GRACE = 5.0


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


# ---- processes -----------------------------------------------------------------------------


class RankError(RuntimeError):
    """A rank of :func:`spawn` failed: ``rank`` and the rank's ``traceback`` (text)."""

    def __init__(self, rank: int, world: int, detail: str):
        super().__init__(f"rank {rank} of {world} failed:\n{detail}")
        self.rank = rank
        self.traceback = detail


def loopback_interface() -> str:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"


def _exit_with(parent) -> None:
    """Wait on the parent's end of a pipe; when it closes (the parent exited, even killed),
    leave at once rather than hang in a collective."""
    try:
        parent.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(1)


def _rank_main(rank: int, world: int, port: int, backend: str, timeout: float, threads: int,
               conn, parent, work: bytes) -> None:
    """The body of one spawned rank: join the group, run ``fn``, send back its result."""
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    # Gloo and NCCL open their own sockets besides the store's: keep them on the loopback too.
    loopback = loopback_interface()
    os.environ["GLOO_SOCKET_IFNAME"] = loopback
    os.environ["NCCL_SOCKET_IFNAME"] = loopback
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        fn, args = pickle.loads(work)
        limit = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, world, False, limit)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=limit)
        result = fn(rank, world, dist.group.WORLD, *args)
        payload = pickle.dumps(("ok", result))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 (whatever fails, the parent hears which rank)
        # When it failed, on the machine-wide monotonic clock: the parent blames the rank that
        # failed first (the others' errors are echoes: their collectives lost a peer).
        payload = pickle.dumps(("error", (time.monotonic(), traceback.format_exc())))
    # Plain pickle, not multiprocessing's: tensors are copied into the message instead of
    # shared through file descriptors that vanish when this process exits.
    conn.send_bytes(payload)
    conn.close()


def _context():
    """multiprocessing's forkserver: a clean process (no CUDA, no threads) started once, which
    imports torch and retiarii once and then forks each rank in milliseconds. A ``spawn``ed
    rank would import them again every time (seconds per rank, per segment). ``torch._dynamo``
    too: the first ``torch.optim`` optimizer of a process imports it (800 modules, 4-8 s)."""
    if "forkserver" not in mp.get_all_start_methods():  # Windows
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", __name__])
    return ctx


def _listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # a free port, on the loopback only
    sock.listen(128)
    return sock


def spawn(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo",
          timeout: float | None = None, threads: int | None = None) -> list[Any]:
    """Run ``fn(rank, world, group, *args)`` on ``world`` local processes forming a
    ``torch.distributed`` process group; their results in rank order.

    The processes come from multiprocessing's forkserver (safe with CUDA and threads, and
    fast: it imports torch once), so ``fn`` and ``args`` must be picklable: ``fn`` a
    module-level function; each rank unpickles its own copy of ``args``. The group meets
    through a TCP store that this process serves on 127.0.0.1 at a free port, and gloo and NCCL
    are told to use the loopback interface: nothing listens on any other address. With
    ``backend="nccl"`` rank r runs on ``cuda:{r % torch.cuda.device_count()}``. Results come
    back pickled (keep them small or on the CPU). When a rank raises or dies, the others are
    stopped at once and :class:`RankError` names the first failing rank with its traceback;
    no process is left behind, whatever happens (ranks exit by themselves when this process
    dies, even killed).

    Example::

        def hello(rank, world, group):
            t = torch.tensor([rank])
            torch.distributed.all_reduce(t, group=group)
            return int(t)

        spawn(hello, 3)        # [3, 3, 3]

    Args:
        fn: the body of a rank, a picklable (module-level) function.
        world: the number of ranks (>= 1).
        *args: passed to ``fn`` after ``(rank, world, group)``; picklable.
        backend: ``"gloo"`` (CPU tensors; CUDA tensors work too, through the host) or
            ``"nccl"`` (one GPU per rank: NCCL refuses two ranks on one GPU).
        timeout: seconds the whole run may take (then the ranks are stopped and
            ``TimeoutError`` raised); also the process group's timeout. None: no limit on the
            run, and a collective waits ``DEFAULT_TIMEOUT`` seconds.
        threads: torch intra-op threads per rank; None shares the cores among the ranks
            (ranks that oversubscribe the cores wait on each other in every collective).
    """
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"spawn needs world >= 1 ranks, got {world!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}: use 'gloo' (CPU, or GPUs through the "
                         "host) or 'nccl' (one GPU per rank)")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < world:
            raise ValueError(f"backend='nccl' needs a GPU per rank: {world} ranks, {gpus} GPUs "
                             "visible (NCCL refuses two ranks on one GPU); use backend='gloo' "
                             "or fewer ranks")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive seconds or None, got {timeout}")
    if threads is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, (cores or 1) // world)
    ctx = _context()
    sock = _listening_socket()
    port = sock.getsockname()[1]
    group_timeout = timeout if timeout is not None else DEFAULT_TIMEOUT
    # This process serves the store on the socket bound above, so no other program can take
    # the port between choosing it and listening on it; the store owns (and closes) it.
    store = dist.TCPStore("127.0.0.1", port, world, True, datetime.timedelta(seconds=group_timeout),
                          wait_for_workers=False, master_listen_fd=sock.detach())
    # Plain pickle again: multiprocessing would move the arguments' tensors to shared memory
    # that all ranks map, and ranks updating them in place (an optimizer's momentum loaded
    # from a state) would update each other's. Each rank gets its own copy.
    # carry: the ranks run in this process's deterministic mode (a job's, in a worker)
    work = pickle.dumps((carry(fn), args))
    # The ranks hold the reading end only: it reads EOF when this process is gone. (Not
    # daemonic processes: a rank may start its own, a DataLoader's workers.)
    alive_r, alive_w = ctx.Pipe(duplex=False)
    procs, readers = [], []
    try:
        for rank in range(world):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_main, name=f"retiarii-rank-{rank}",
                               args=(rank, world, port, backend, group_timeout, threads, writer,
                                     alive_r, work))
            proc.start()
            writer.close()  # the child holds the only writing end: EOF when it dies
            procs.append(proc)
            readers.append(reader)
        return _collect(procs, readers, world, timeout)
    finally:
        _stop(procs)
        for reader in readers:
            reader.close()
        alive_r.close()
        alive_w.close()
        del store


def _collect(procs: list, readers: list, world: int, timeout: float | None) -> list[Any]:
    """Wait for every rank's message; raise at the deadline or when a rank failed.

    One failure brings others: ranks waiting in a collective with the failed one lose their
    connection and fail too. So after the first failure the others get ``_GRACE`` seconds to
    report, and the blame goes to a rank that died without a word (a crash is nobody's echo),
    else to the error raised first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    results: dict[int, Any] = {}
    failures: list[tuple[int, float, int, str]] = []  # (0 died / 1 raised, when, rank, detail)
    grace_end = None  # the first failure's time + _GRACE
    waiting = dict(enumerate(readers))
    while waiting:
        ends = [t for t in (deadline, grace_end) if t is not None]
        left = max(0.0, min(ends) - time.monotonic()) if ends else None
        ready = mp.connection.wait(list(waiting.values()), timeout=left)
        if not ready:  # only with a time limit: the deadline or the grace period is over
            break
        for reader in ready:
            rank = readers.index(reader)
            del waiting[rank]
            try:
                status, value = pickle.loads(reader.recv_bytes())
            except EOFError:  # the rank died without a word: killed, os._exit, a crash
                procs[rank].join(_GRACE)
                failures.append((0, time.monotonic(), rank,
                                 f"the process exited with code {procs[rank].exitcode} before "
                                 "returning a result (killed, out of memory, or os._exit)"))
                continue
            if status == "error":
                failures.append((1, value[0], rank, value[1]))
            else:
                results[rank] = value
        if failures and grace_end is None:
            grace_end = time.monotonic() + _GRACE
    failures.sort()
    if failures:
        raise RankError(failures[0][2], world, failures[0][3])
    if waiting:
        raise TimeoutError(f"spawn: ranks {sorted(waiting)} of {world} did not finish within "
                           f"{timeout} s; all ranks were stopped")
    return [results[r] for r in range(world)]


def _stop(procs: list) -> None:
    """Join the ranks that finished; terminate, then kill, the others; reap them all."""
    for proc in procs:
        if proc.is_alive():
            proc.join(0.5 if proc.exitcode is None else 0)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(_GRACE)
        if proc.is_alive():
            proc.kill()
            proc.join()


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
    """One rank's part of :func:`run_segment_on_ranks` (any launcher of ranks runs it, e.g.
    :func:`retiarii.engine.executors.ray_ranks.run_segment_on_actors`): rank 0 returns
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


def run_segment_on_ranks(build: Callable[[], tuple[Any, Any]], state: dict | None, world: int,
                         backend: str = "gloo", timeout: float | None = None) -> tuple[Any, dict]:
    """Run one segment of a one-shot strategy on ``world`` ranks with mixed parallelism.

    Every rank calls ``build()`` for its ``(strategy, ctx)`` (a
    :class:`~retiarii.strategies.one_shot.OneShot` after ``setup`` and its
    :class:`~retiarii.strategies.one_shot.SegmentContext`), loads ``state`` when given, sets
    ``ctx.rank``, ``ctx.world``, ``ctx.group`` and ``ctx.train`` to its share of the training
    batches (rank r takes batches r, r + K, ...; the last ``len % K`` are left out so that
    every rank takes as many steps; the batches must come in the same order on every rank, as
    the trainers' loaders seeded by the segment do), and runs ``strategy.run_segment(ctx)``. The strategy
    trains its rank's own sampled model on each batch and calls :func:`average_used_gradients`
    when ``ctx.world > 1``; it must draw the same samples on every rank (the same RNG state)
    and take the one of its rank, so the ranks' states stay equal and rank 0's is the state of
    the whole run. BatchNorm running statistics are the one exception: per rank by design;
    rank 0's come back and every rank resumes from them.

    Example::

        result, state = run_segment_on_ranks(functools.partial(build, seed=0), None, 2)
        result, state = run_segment_on_ranks(functools.partial(build, seed=0), state, 2)

    Args:
        build: a picklable callable (module-level function or ``functools.partial`` of one)
            returning ``(strategy, ctx)``. With ``backend="nccl"`` each rank's current CUDA
            device is set first, so ``torch.device("cuda")`` is the rank's own GPU.
        state: a ``strategy.state_dict()`` to continue from, or None to start afresh.
        world: the number of ranks K.
        backend: ``"gloo"`` or ``"nccl"``, as for :func:`spawn`.
        timeout: seconds the segment may take, as for :func:`spawn`.

    Returns:
        ``(result, state)``: rank 0's ``SegmentResult`` whose ``models`` are the models every
        rank evaluated, rank 0's first, then rank 1's, ...; and rank 0's ``state_dict()`` with
        its tensors on the CPU.
    """
    return gather_segment(spawn(segment_rank, world, build, state, backend=backend,
                                timeout=timeout))


def gather_segment(outcomes: list) -> tuple[Any, dict]:
    """``(result, state)`` of a segment from its ranks' :func:`segment_rank` outcomes in rank
    order: rank 0's result with every rank's models (rank 0's first), and rank 0's state."""
    result, new_state = outcomes[0]
    models = list(result.models) + [m for ranked in outcomes[1:] for m in ranked]
    return dataclasses.replace(result, models=models), new_state
