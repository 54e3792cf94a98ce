"""The worker actor of :class:`~.ray.RayExecutor`: one slot's process on the Ray cluster.

It runs :func:`retiarii.engine.worker_side.worker.run_job` on the jobs the driver hands it and queues the
events for the driver's long poll (the protocol: :mod:`.ray`'s module docstring); a ranked
one-shot segment's ranks run as rank actors in a placement group (:mod:`.ray_ranks`).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import shutil
import sys
import tempfile
import threading
from typing import Any

import ray

from ...determinism import prepare_worker
from ..jobs.job import Event, Job, JobFailed, JobFinished, TrialCheckpointed
from .ray_transfer import localize

__all__ = ["WorkerActor"]


class WorkerActor:
    """One slot's worker: trains one job at a time, queues its events for the driver's poll.

    Created with ``max_concurrency=2`` so that :meth:`events` answers while :meth:`run` trains.
    """

    def __init__(self, name: str, threads: int, sys_path: list[str], ranks: dict[str, Any]):
        # The driver's import path first (as multiprocessing's spawn gives a child): a space
        # module beside the driver's script imports here too.
        sys.path[:0] = [p for p in sys_path if p not in sys.path]
        prepare_worker()  # before CUDA starts: any job of this worker may be deterministic
        if (ranks.get("runtime_env") or {}).get("working_dir"):
            # Ray runs this actor in its node's copy of the job's working_dir (the space
            # file's folder, shipped by `retiarii run --executor ray --address`): a space
            # file path of the driver that this node lacks is loaded from that copy.
            from ...refs import add_shipped_folder

            add_shipped_folder(os.getcwd())
        import functools
        import torch

        torch.set_num_threads(threads)
        # The first optimizer imports torch._dynamo (~2 s): pay it before saying we are ready.
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        from ..worker_side.worker import WorkerContext

        from .ray_ranks import RankGroup

        self.name, self.context = name, WorkerContext()
        # a ranked segment's K ranks: rank actors in a placement group, not local processes;
        # kept between the segments of a search (they die with this actor, and the executor
        # removes their placement group by its prefix)
        self._new_group = functools.partial(RankGroup, sys_path=list(sys_path), **ranks)
        self._groups: dict[int, Any] = {}
        self.context.run_ranks = self._run_ranks
        self.scratch = tempfile.mkdtemp(prefix=f"retiarii-{name}-")
        self._items: collections.deque = collections.deque()
        self._changed = threading.Condition()

    def _run_ranks(self, build, state, world: int, keep: bool = False) -> tuple[Any, dict]:
        """A ranked segment on this worker's rank group of ``world`` ranks (started on first
        use); ``keep``: more segments follow, keep the group for them, else close it."""
        for other in [w for w in self._groups if w != world]:  # one group held at a time
            self._groups.pop(other).close()
        group = self._groups.pop(world, None) or self._new_group(world)
        result = group.run(build, state)  # (a failure closes the group)
        if keep:
            self._groups[world] = group
        else:
            group.close()
        return result

    def ready(self) -> tuple[int, str]:
        """(process id, node id): the driver's proof that the actor is up."""
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def run(self, job: Job, blobs: dict[str, bytes | None] | None) -> None:
        """Train ``job``; ``blobs`` (transfer mode) holds each task's ``checkpoint_in`` bytes."""
        from ..worker_side.worker import describe_error, run_job

        workdir = None
        outputs: dict[str, str] = {}  # local checkpoint_out -> the driver's path
        terminal = False

        def emit(event: Event) -> None:
            nonlocal terminal
            data = None
            if isinstance(event, TrialCheckpointed) and event.path in outputs:
                with open(event.path, "rb") as f:
                    data = f.read()
                os.unlink(event.path)
                event = dataclasses.replace(event, path=outputs[event.path])
            terminal = isinstance(event, (JobFinished, JobFailed))
            self._push((event, data))

        try:
            if blobs is not None:
                workdir = tempfile.mkdtemp(dir=self.scratch)
                job = localize(job, blobs, workdir, outputs)
            run_job(job, emit, worker=self.name, context=self.context)
        except BaseException as err:  # noqa: BLE001 (not a trial's fault: reporting itself failed)
            if not terminal:
                self._push((JobFailed(job.job_id, None, describe_error(err)), None))
        finally:
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)

    def events(self, wait: float) -> list[tuple[Event, bytes | None]]:
        """Every queued (event, checkpoint bytes) pair; blocks up to ``wait`` s for the first."""
        with self._changed:
            self._changed.wait_for(lambda: self._items, timeout=wait)
            items = list(self._items)
            self._items.clear()
        return items

    def _push(self, item: tuple[Event, bytes | None]) -> None:
        with self._changed:
            self._items.append(item)
            self._changed.notify_all()
