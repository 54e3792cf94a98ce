"""Mixed-parallel segments on Ray: K rank actors in one placement group, one process group.

:func:`~.local_ranks.run_segment_on_ranks` forks K local processes, outside
Ray's resource accounting. On Ray a ranked segment (``Experiment(..., executor="ray",
ranks=K)``) runs through :func:`run_segment_on_actors` instead: the worker actor that holds
the job creates a placement group of K bundles (PACK: on one node when it fits, so the
collectives stay local, spread over nodes otherwise), one :class:`_RankActor` per bundle,
asks rank 0 for its node's IP and a port it listens on (the ``TCPStore`` of the group,
served by rank 0 on a socket bound before anyone is told the port), and has every rank join
the ``torch.distributed`` group and run
:func:`~retiarii.optim.mixed_parallel.segment_rank`, the very function the local ranks run.
The results are gathered in rank order exactly as ``run_segment_on_ranks`` gathers them,
through the same loop (:func:`~.local_ranks.collect_ranks`).

What travels: ``build`` and ``state`` are pickled once into bytes and each rank unpickles its
own copy (tensors deserialized straight from Ray's shared object store could be shared by
the ranks of one node, and an optimizer state loaded from them would be updated by all of
them); results come back pickled the same way.

Failures: a rank that raises reports its traceback; a rank whose actor dies (killed, its node
lost) is noticed by ``ray.wait``. After the first failure the others get a few seconds to
report (their collectives lose a peer and fail too: echoes), then :class:`RankError` names
the rank that failed first (one that died without a word before one that raised; a dead
actor is a :class:`RankLost`, which the engine retries as a lost worker). Whatever
happens, every rank actor is killed and the placement group removed before this returns.

Who cleans up when the *worker actor* itself is killed (cancel, a lost node): the rank actors
are created by the worker actor, so Ray kills them with it (an actor's children share its
fate unless detached). A placement group outlives its creator, though, so it carries a name
that starts with the worker's ``group_prefix`` and :class:`~.ray.RayExecutor` removes the
groups of that prefix (and with them any actor still in them) when it kills or loses the
worker: :func:`remove_groups`.
"""
from __future__ import annotations

import datetime
import ipaddress
import itertools
import os
import pickle
import socket
import sys
import time
import traceback
from typing import Any, Callable

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import (
    PlacementGroup, placement_group, remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ...determinism import carry, prepare_worker
from ...optim.mixed_parallel import gather_segment, segment_rank

from .local_ranks import DEFAULT_TIMEOUT, RankError, collect_ranks, loopback_interface
from .ray_local import split_runtime_env

__all__ = ["PlacementError", "RankGroup", "RankLost", "run_segment_on_actors", "remove_groups"]

# How long the placement group may take to be placed when the caller gives no limit.
DEFAULT_PLACEMENT_TIMEOUT = 60.0
_WAIT_SLICE = 30.0  # longest single ray.wait when there is no deadline
_counter = itertools.count()


class PlacementError(TimeoutError):
    """The placement group of a ranked segment could not be placed within its timeout.

    A ``TimeoutError`` (an ``OSError``): the engine counts it as the environment's fault, so
    the segment is retried and, if the cluster stays too small, the search stops resumable."""


class RankLost(RankError, ConnectionError):
    """A rank's actor died (killed, out of memory, its node lost): a :class:`RankError` that
    is also an ``OSError``, so the engine counts it as the environment's fault and retries
    the segment from its unit, as it does for a lost worker."""


class _RankActor:
    """One rank: joins the group, runs the rank's function, returns its pickled outcome."""

    def __init__(self, sys_path: list[str], threads: int):
        sys.path[:0] = [p for p in sys_path if p not in sys.path]
        prepare_worker()  # before CUDA starts: the segment may be deterministic
        import torch

        torch.set_num_threads(threads)
        self._listener: socket.socket | None = None

    def address(self) -> tuple[str, int]:
        """(this node's IP, a port bound and listening on it): where the group's store will
        be (rank 0 only). Bound now, so no other program takes the port meanwhile."""
        host = ray.util.get_node_ip_address()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(128)
        self._listener = sock
        return host, sock.getsockname()[1]

    def run(self, rank: int, world: int, host: str, port: int, backend: str, timeout: float,
            work: bytes) -> tuple[str, Any]:
        """``("ok", pickled result)`` or ``("error", (wall time, traceback))``."""
        import torch.distributed as dist

        if ipaddress.ip_address(host).is_loopback:  # gloo's and NCCL's own sockets too
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = \
                loopback_interface()
        try:
            fn, args = pickle.loads(work)
            limit = datetime.timedelta(seconds=timeout)
            if rank == 0:
                listener, self._listener = self._listener, None
                store = dist.TCPStore(host, port, world, True, limit, wait_for_workers=False,
                                      master_listen_fd=listener.detach())
            else:
                store = dist.TCPStore(host, port, world, False, limit)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                    timeout=limit)
            result = fn(rank, world, dist.group.WORLD, *args)
            dist.destroy_process_group()
            return "ok", pickle.dumps(result)
        except BaseException:  # noqa: BLE001 (whatever fails, the caller hears which rank)
            failed = (time.time(), traceback.format_exc())
            try:  # close this rank's connections: the peers waiting on it fail now, not later
                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001 (the error reported is the first one)
                pass
            return "error", failed


def _bundle(num_cpus: float, num_gpus: float) -> dict[str, float]:
    bundle = {k: v for k, v in (("CPU", num_cpus), ("GPU", num_gpus)) if v > 0}
    if not bundle:
        raise ValueError("a rank needs some resources: num_cpus or num_gpus > 0")
    return bundle


def _free(resources: dict[str, float]) -> str:
    return ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())
                     if k in ("CPU", "GPU")) or "nothing"


class RankGroup:
    """K rank actors in one placement group, kept from one segment to the next.

    :func:`run_segment_on_actors` makes one for a single segment. The RayExecutor's worker
    actor keeps one between the segments of a search (``run(..., keep=True)``): creating the
    group and K actors that import torch costs seconds per segment, more than a short
    segment trains. Each :meth:`run` forms a new ``torch.distributed`` group on the same
    actors (a fresh store port), so a segment on kept actors computes what one on fresh actors
    does. Any failure closes the group (a rank that failed may have left its process in any
    state); :meth:`close` kills the actors and removes the placement group (idempotent).

    Args: as :func:`run_segment_on_actors` (without ``build``, ``state`` and ``timeout``).
    """

    def __init__(self, world: int, *, num_cpus: float = 1.0, num_gpus: float = 0.0,
                 backend: str | None = None, sys_path: list[str] | None = None,
                 placement_timeout: float = DEFAULT_PLACEMENT_TIMEOUT,
                 group_prefix: str = "retiarii-ranks-", runtime_env: dict | None = None):
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"run_segment_on_actors needs world >= 1 ranks, got {world!r}")
        if backend is None:
            backend = "nccl" if num_gpus >= 1 else "gloo"
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown backend {backend!r}: use 'gloo' or 'nccl'")
        if backend == "nccl" and num_gpus < 1:
            raise ValueError(f"backend='nccl' needs a whole GPU per rank, got num_gpus="
                             f"{num_gpus}; use backend='gloo' to share GPUs between ranks")
        self.world, self.backend = world, backend
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.bundle = _bundle(num_cpus, num_gpus)
        self.sys_path, self.runtime_env = list(sys_path or []), runtime_env
        self.placement_timeout, self.group_prefix = placement_timeout, group_prefix
        self._pg: PlacementGroup | None = None
        self._actors: list[Any] = []

    @property
    def started(self) -> bool:
        return bool(self._actors)

    def _start(self) -> None:
        if not ray.is_initialized():  # Ray would start an instance of its own, everywhere
            raise RuntimeError("run_segment_on_actors needs a connected Ray: call "
                               "ray.init(address=...) or retiarii.engine.executors.ray."
                               "start_local_ray() first")
        world, bundle = self.world, self.bundle
        name = f"{self.group_prefix}{os.getpid()}-{next(_counter)}"
        self._pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK",
                                   name=name)
        if not self._pg.wait(timeout_seconds=self.placement_timeout):
            raise PlacementError(
                f"the cluster could not place {world} ranks of {bundle} each (one placement "
                f"group, PACK) within {self.placement_timeout:g} s; the cluster has "
                f"{_free(ray.cluster_resources())} in all, {_free(ray.available_resources())} "
                "free. Give fewer ranks, smaller num_cpus/num_gpus, or a larger cluster")
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                                   "max_restarts": 0, "max_task_retries": 0}
        actor_env = split_runtime_env(self.runtime_env)[1]  # the job's part: uploaded already
        if actor_env:
            options["runtime_env"] = actor_env
        cls = ray.remote(_RankActor)
        threads = max(1, int(self.num_cpus))
        for rank in range(world):
            strategy = PlacementGroupSchedulingStrategy(self._pg,
                                                        placement_group_bundle_index=rank)
            self._actors.append(cls.options(scheduling_strategy=strategy, **options).remote(
                self.sys_path, threads))

    def run(self, build: Callable[[], tuple[Any, Any]], state: dict | None,
            timeout: float | None = None) -> tuple[Any, dict]:
        """One segment on the group's actors (started on first use); see
        :func:`run_segment_on_actors`."""
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive seconds or None, got {timeout}")
        try:
            if not self._actors:
                self._start()
            world, actors = self.world, self._actors
            # the ranks run in the worker's deterministic mode (the job's)
            work = pickle.dumps((carry(segment_rank), (build, state)))
            group_timeout = timeout if timeout is not None else DEFAULT_TIMEOUT
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                host, port = ray.get(actors[0].address.remote(),
                                     timeout=_left(deadline, 600.0))
            except RayActorError as err:
                raise RankLost(0, world, f"its actor died while starting: {err}") from None
            refs = {actors[r].run.remote(r, world, host, port, self.backend, group_timeout,
                                         work): r for r in range(world)}
            outcomes = _collect(refs, world, deadline, timeout)
            return gather_segment([pickle.loads(o) for o in outcomes])
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kill the rank actors and remove the placement group."""
        actors, self._actors = self._actors, []
        for actor in actors:
            try:
                ray.kill(actor)
            except RayError:
                pass  # already gone
        pg, self._pg = self._pg, None
        if pg is not None:
            remove_placement_group(pg)


def run_segment_on_actors(build: Callable[[], tuple[Any, Any]], state: dict | None, world: int,
                          *, num_cpus: float = 1.0, num_gpus: float = 0.0,
                          backend: str | None = None, sys_path: list[str] | None = None,
                          timeout: float | None = None,
                          placement_timeout: float = DEFAULT_PLACEMENT_TIMEOUT,
                          group_prefix: str = "retiarii-ranks-",
                          runtime_env: dict | None = None) -> tuple[Any, dict]:
    """:func:`~.local_ranks.run_segment_on_ranks` on ``world`` Ray actors
    (a :class:`RankGroup` for this segment alone: nothing is left after it).

    Call it where Ray is initialized (a driver, or an actor such as the RayExecutor's worker).

    Example::

        result, state = run_segment_on_actors(functools.partial(build, seed=0), None, 2,
                                              num_cpus=2, timeout=600)

    Args:
        build, state, world: as for ``run_segment_on_ranks`` (``build`` picklable).
        num_cpus, num_gpus: each rank's bundle of the placement group (and its actor's
            resources); torch threads per rank: ``num_cpus`` rounded down, at least 1.
        backend: ``"gloo"`` or ``"nccl"``; None: NCCL when each rank holds a whole GPU.
        sys_path: entries put first on each rank's import path (the caller's, on one machine).
        timeout: seconds the segment may take once placed (then ``TimeoutError``); also the
            process group's timeout. None: no limit, collectives wait ``DEFAULT_TIMEOUT``.
        placement_timeout: seconds to wait for the cluster to place the group
            (``PlacementError`` after it, naming what was asked and what the cluster has).
        group_prefix: the placement group's name starts with it (see :func:`remove_groups`).
        runtime_env: Ray runtime environment of the rank actors.

    Returns:
        ``(result, state)`` exactly as ``run_segment_on_ranks`` returns them.
    """
    group = RankGroup(world, num_cpus=num_cpus, num_gpus=num_gpus, backend=backend,
                      sys_path=sys_path, placement_timeout=placement_timeout,
                      group_prefix=group_prefix, runtime_env=runtime_env)
    try:  # (run checks the timeout and that Ray is connected before starting anything)
        return group.run(build, state, timeout)
    finally:
        group.close()


def _left(deadline: float | None, cap: float) -> float:
    return cap if deadline is None else max(0.0, min(cap, deadline - time.monotonic()))


def _collect(refs: dict, world: int, deadline: float | None, timeout: float | None) -> list:
    """Every rank's pickled result in rank order, through :func:`~.local_ranks.collect_ranks`:
    :class:`RankError` for the first failure (:class:`RankLost` for a dead actor),
    ``TimeoutError`` at the deadline."""
    def wait(pending: list, left: float | None) -> list:
        return ray.wait(pending, num_returns=1, timeout=min(left, _WAIT_SLICE)
                        if left is not None else _WAIT_SLICE)[0]

    def read(ref, rank: int) -> tuple[str, Any]:
        try:
            return ray.get(ref, timeout=0)
        except RayActorError as err:  # killed, out of memory, its node lost
            return "died", (time.time(), f"its actor died before returning a result: "
                                         f"{str(err).strip().splitlines()[0]}")
        except RayError as err:
            return "died", (time.time(), f"its call failed: {err}")

    return collect_ranks(refs, wait, read, world, deadline, lost=RankLost,
                         late=lambda ranks: (f"ranks {ranks} of {world} did not finish within "
                                             f"{timeout} s; every rank actor was stopped"))


def remove_groups(*prefixes: str) -> int:
    """Remove every live placement group whose name starts with one of ``prefixes`` (and so
    every actor in it): what a killed worker actor leaves of its ranked segment. How many."""
    if not prefixes:
        return 0
    removed = 0
    for group_id, info in ray.util.placement_group_table().items():
        name = info.get("name") or ""
        if name.startswith(tuple(prefixes)) and info.get("state") != "REMOVED":
            try:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group_id)))
                removed += 1
            except (ValueError, RayError):
                pass  # removed meanwhile
    return removed
