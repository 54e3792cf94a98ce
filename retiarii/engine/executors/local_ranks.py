"""Ranks on local processes: K forkserver processes forming a torch.distributed group.

The launcher of mixed parallelism on one machine (:mod:`retiarii.optim.mixed_parallel` holds
what runs on each rank): :func:`spawn` runs a function on K local ranks, and
:func:`run_segment_on_ranks` runs one segment of a one-shot strategy on them, what the engine
calls for a ranked job. :func:`collect_ranks` is the one loop that gathers the ranks'
outcomes and blames the rank that failed first; the Ray launcher
(:mod:`.ray_ranks`) gathers its rank actors' outcomes through it too (an example: spawn's
docstring).
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import socket
import threading
import time
import traceback
from typing import Any, Callable, Hashable

import torch
import torch.distributed as dist

from ...determinism import carry
from ...optim.mixed_parallel import gather_segment, segment_rank

__all__ = ["DEFAULT_TIMEOUT", "GRACE", "RankError", "collect_ranks", "loopback_interface",
           "run_segment_on_ranks", "spawn"]

# How long a process group waits in a collective when spawn() is given no timeout: DDP's own
# default. A rank that fails makes spawn() stop the others at once, so this matters only for
# ranks that hang without failing.
DEFAULT_TIMEOUT = 1800.0

# After the first failure, how long the other ranks get to report; after terminate(), how long
# a rank gets to exit before it is killed.
GRACE = 5.0


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


# ---- the ranks' outcomes, whatever launched them -----------------------------------------


def collect_ranks(pending: dict[Hashable, int], wait: Callable[[list, float | None], list],
                  read: Callable[[Hashable, int], tuple[str, Any]], world: int,
                  deadline: float | None, *, lost: type[RankError] = RankError,
                  late: Callable[[list[int]], str]) -> list[Any]:
    """Every rank's result in rank order; raise at the deadline or when a rank failed.

    One failure brings others: ranks waiting in a collective with the failed one lose their
    connection and fail too. So after the first failure the others get ``GRACE`` seconds to
    report, and the blame goes to a rank that died without a word (a crash is nobody's echo),
    else to the error raised first.

    Args:
        pending: a handle per rank (a pipe's reading end, a Ray object ref) -> its rank.
        wait: ``wait(handles, seconds or None)`` -> the handles ready now (maybe none).
        read: ``read(handle, rank)`` -> ``("ok", result)``, ``("error", (when, traceback))``
            for a rank that raised, or ``("died", (when, detail))`` for one that died without
            a word; ``when`` on a clock that the ranks of one launcher share.
        world: the number of ranks.
        deadline: ``time.monotonic()`` at which to give up, or None.
        lost: the error for a rank that died (the one raised for a rank that raised is a
            :class:`RankError`).
        late: the message of the ``TimeoutError`` for the ranks (sorted) not done in time.
    """
    pending = dict(pending)
    results: dict[int, Any] = {}
    failures: list[tuple[int, float, int, str]] = []  # (0 died / 1 raised, when, rank, detail)
    grace_end = None  # the first failure's time + GRACE
    while pending:
        ends = [t for t in (deadline, grace_end) if t is not None]
        if ends and time.monotonic() >= min(ends):  # the deadline or the grace period is over
            break
        left = max(0.0, min(ends) - time.monotonic()) if ends else None
        for handle in wait(list(pending), left):
            rank = pending.pop(handle)
            status, value = read(handle, rank)
            if status == "ok":
                results[rank] = value
            else:
                failures.append((0 if status == "died" else 1, value[0], rank, value[1]))
        if failures and grace_end is None:
            grace_end = time.monotonic() + GRACE
    failures.sort()
    if failures:
        died, _, rank, detail = failures[0]
        raise (lost if died == 0 else RankError)(rank, world, detail)
    if pending:
        raise TimeoutError(late(sorted(pending.values())))
    return [results[r] for r in range(world)]


# ---- local processes ---------------------------------------------------------------------


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
    """The ranks' results through :func:`collect_ranks`, read from their pipes."""
    def read(reader, rank: int) -> tuple[str, Any]:
        try:
            return pickle.loads(reader.recv_bytes())
        except EOFError:  # the rank died without a word: killed, os._exit, a crash
            procs[rank].join(GRACE)
            return "died", (time.monotonic(),
                            f"the process exited with code {procs[rank].exitcode} before "
                            "returning a result (killed, out of memory, or os._exit)")

    return collect_ranks(
        {reader: rank for rank, reader in enumerate(readers)},
        lambda handles, left: mp.connection.wait(handles, timeout=left), read, world,
        None if timeout is None else time.monotonic() + timeout,
        late=lambda ranks: (f"spawn: ranks {ranks} of {world} did not finish within "
                            f"{timeout} s; all ranks were stopped"))


def _stop(procs: list) -> None:
    """Join the ranks that finished; terminate, then kill, the others; reap them all."""
    for proc in procs:
        if proc.is_alive():
            proc.join(0.5 if proc.exitcode is None else 0)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(GRACE)
        if proc.is_alive():
            proc.kill()
            proc.join()


# ---- a segment of a one-shot strategy on K local ranks -------------------------------------


def run_segment_on_ranks(build: Callable[[], tuple[Any, Any]], state: dict | None, world: int,
                         backend: str = "gloo", timeout: float | None = None) -> tuple[Any, dict]:
    """Run one segment of a one-shot strategy on ``world`` local ranks with mixed parallelism.

    Every rank runs :func:`~retiarii.optim.mixed_parallel.segment_rank`: it calls ``build()``
    for its ``(strategy, ctx)`` (a :class:`~retiarii.strategies.one_shot.OneShot` after
    ``setup`` and its :class:`~retiarii.strategies.one_shot.SegmentContext`), loads ``state``
    when given, sets ``ctx.rank``, ``ctx.world``, ``ctx.group`` and ``ctx.train`` to its share
    of the training batches (rank r takes batches r, r + K, ...; the last ``len % K`` are left
    out so that every rank takes as many steps; the batches must come in the same order on
    every rank, as the trainers' loaders seeded by the segment do), and runs
    ``strategy.run_segment(ctx)``. The strategy trains its rank's own sampled model on each
    batch and calls :func:`~retiarii.optim.mixed_parallel.average_used_gradients` when
    ``ctx.world > 1``; it must draw the same samples on every rank (the same RNG state) and
    take the one of its rank, so the ranks' states stay equal and rank 0's is the state of the
    whole run. BatchNorm running statistics are the one exception: per rank by design; rank
    0's come back and every rank resumes from them.

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
