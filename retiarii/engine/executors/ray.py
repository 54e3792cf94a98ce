"""RayExecutor: the same jobs on a Ray cluster, one long-lived worker actor per slot.

Each slot is one Ray actor (:class:`WorkerActor`) holding ``num_cpus`` CPUs and ``num_gpus``
GPUs (a fraction lets several slots share a GPU; Ray sets ``CUDA_VISIBLE_DEVICES`` for it). The
actor runs :func:`retiarii.engine.worker_side.worker.run_job` on the jobs it is handed, exactly as a local
worker does, so it rebuilds every model from the trial's spec; models never travel pickled.

**How events stream back: a long poll.** An actor is threaded (two concurrent calls). ``run(job)``
trains the job in one thread and pushes every event ``run_job`` emits onto a queue inside the
actor; ``events(wait)`` blocks (inside the actor, at most ``wait`` seconds) until that queue holds
something and returns all of it. The driver keeps exactly one ``events`` call outstanding per
actor (idle ones too: an idle actor's call returns empty every ``poll_wait`` seconds, and its
failure is how the death of an idle actor is noticed at once), and
:meth:`RayExecutor.next_event` blocks in one ``ray.wait`` over every outstanding call (with a
timeout: Ray's own wait, no sleep-polling here). A ``TrialResult`` therefore
reaches the driver one actor call after its epoch ends, however long the job (per model, a
few milliseconds more than LocalExecutor's pipe: ``benchmarks/ray_overhead.py``). When a call
returns, the driver queues its events and issues the next one.

Why not one call per job returning its events at the end: the scheduler needs every epoch's
result as it happens (ASHA stops a trial after its first rung). Why not a streaming generator:
``run_job`` reports through a callback, and the explicit queue keeps the actor's side (a
thread, a condition) and the driver's side (one outstanding call) small and easy to reason about.

**Failures.** A job's own errors come back as events (a model that raises fails its trial only).
An actor that dies (its process SIGKILLed, the OOM killer, its node lost) makes its outstanding
call raise ``RayActorError``: the job ends with ``JobFailed(worker_lost=True)``, the slot gets
a new actor, and the runner retries the trials from their last checkpoints, wherever a slot is
free. Actors are created with ``max_restarts=0``: Ray never restarts one behind our back, so a
slot's state is only ever what the driver made it.

**Cancel** kills the actor and starts a replacement (a Ray actor call cannot be interrupted, so
this is the only way to stop the work at once); the job ends with ``JobFailed("cancelled")`` and
no event of it follows.

**Checkpoints.** With ``shared_storage=True`` the actors read and write checkpoint paths directly
(the run directory on a filesystem every node mounts, or one machine). With
``shared_storage=False`` their bytes travel through Ray's object store (:mod:`.ray_transfer`).

**The Ray instance.** With an ``address`` the executor connects to that cluster (and only
disconnects on :meth:`close`). Without one it uses the Ray this process is already connected to,
or starts a private local instance (:func:`start_local_ray`): bound to 127.0.0.1 only, no
dashboard, its own temporary directory; :meth:`close` shuts it down and removes that directory.
Nothing is started before the first ``submit``/``next_event``/``wait_ready`` (so an executor can
be built cheaply, e.g. by the CLI, and handed to an :class:`~retiarii.Experiment`).

**Mixed-parallel jobs** (a one-shot segment with ``ranks`` K > 1) run on K rank actors in one
placement group (:mod:`.ray_ranks`), created by the worker actor that holds the job, each with
a slot's resources; the executor removes a worker actor's groups (by their name prefix)
whenever it kills or loses that actor (cancel, a lost node, close).

The executor is driven from one thread (the trial runner's), like the engine's loop itself.
"""
from __future__ import annotations

import atexit
import collections
import logging
import math
import os
import shutil
import sys
import time
import uuid
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayError

from ..errors import EnvironmentFailure
from . import ray_health
from ..jobs.job import Event, Executor, Job, JobFailed, JobFinished, pick_slot
from .ray_local import split_runtime_env, start_local_ray
from .ray_transfer import read_inputs, write_atomically
from .ray_worker import WorkerActor

__all__ = ["RayExecutor", "start_local_ray"]

_log = logging.getLogger("retiarii.engine.ray")
_WAIT_SLICE = 60.0  # longest single ray.wait when next_event has no timeout (re-entered after)


# ---- the driver's side ----------------------------------------------------------------------


class _Slot:
    """One slot: its current actor and what the driver knows about it."""

    def __init__(self, index: int):
        self.name = f"ray-{index}"
        self.actor: Any = None
        self.ready = False
        self.pid: int | None = None
        self.node: str | None = None
        self.job: Job | None = None
        self.run_ref: Any = None  # kept so Ray keeps the call's result until the job ends
        self.last_used = 0
        self.failed_starts = 0
        self.beat = 0.0  # when its actor last answered, or was created (ray_health's deadlines)
        self.start_warned = False  # told the user it cannot start while others work
        self.groups = ""  # the name prefix of the placement groups its actor creates


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor)
    except RayError:
        pass  # already gone


class RayExecutor(Executor):
    """Runs jobs on Ray worker actors, one per slot.

    Example::

        with RayExecutor(num_workers=4, num_cpus=2, num_gpus=0.5) as ex:  # 2 slots per GPU
            ex.submit(Job("j1", [TrialTask("t1", spec, 0, 2, None, "runs/ckpt/t1-2.pt")]))
            while not isinstance(event := ex.next_event(), (JobFinished, JobFailed)):
                print(event)

    or ``rt.Experiment(..., executor="ray")``, ``retiarii run SPACE --executor ray``.

    Args:
        num_workers: slots, i.e. worker actors.
        address: a Ray cluster to connect to (``"auto"``, ``"HOST:PORT"``, ``"ray://HOST:10001"``);
            None: the Ray this process is connected to, else a private local instance.
        num_cpus: logical CPUs each actor holds (Ray's scheduling unit; may be a fraction).
        num_gpus: GPUs each actor holds; a fraction (0.25) packs several slots on one GPU.
        resources: custom Ray resources each actor holds (``{"node:10.0.0.5": 0.01}`` pins it).
        threads_per_worker: torch threads in each actor. Default: ``num_cpus`` rounded down, at
            least 1 (the CPUs it holds, so actors sharing a node do not oversubscribe it).
        shared_storage: True when every actor can read and write the driver's checkpoint paths
            (one machine, or a run directory on NFS mounted at the same path everywhere); False
            moves checkpoint bytes through Ray's object store. Default: True for a local
            instance (started here or already connected to without an address), False with an
            ``address``.
        runtime_env: Ray runtime environment of the actors (``{"py_modules": [...]}``...), for
            code that is not installed on the nodes.
        poll_wait: seconds an actor's ``events`` call waits for a first event before returning
            empty (the driver then asks again); bounds how long any actor thread is parked.
        ranks: the K of the mixed-parallel segments this executor will run (``Experiment``
            passes its ``ranks``): each of them also needs K bundles of a slot's resources
            (:mod:`.ray_ranks`), so a private local instance offers that many more logical
            CPUs, and a cluster that cannot hold a slot and its ranks is warned about.
        heartbeat_timeout: an actor silent this long (no event and no empty answer to its
            ``events`` call, which returns every ``poll_wait`` s) is hung: it is killed and its
            job retried, as LocalExecutor does with a worker whose heartbeats stop (None: never).
        startup_timeout: seconds an actor may take to become ready (placed on a node with room,
            torch imported); when no slot is ready after it, nothing can run and
            :meth:`next_event` raises :class:`~retiarii.engine.errors.EnvironmentFailure`
            (:mod:`.ray_health`). So does a cluster with no live node left.
    """

    @classmethod
    def for_search(cls, workers: int, devices=None, *, one_shot: bool = False, ranks: int = 1,
                   **options) -> "RayExecutor":
        """The executor an Experiment makes for its search (the registry's ``"ray"``): a slot
        per worker (one for a one-shot search, its segments on ``ranks`` ranks). ``devices``
        does not apply: Ray places the actors."""
        return cls(1 if one_shot else workers, ranks=ranks, **options)

    def __init__(self, num_workers: int = 2, *, address: str | None = None, num_cpus: float = 1.0,
                 num_gpus: float = 0.0, resources: dict[str, float] | None = None,
                 threads_per_worker: int | None = None, shared_storage: bool | None = None,
                 runtime_env: dict | None = None, poll_wait: float = 30.0, ranks: int = 1,
                 heartbeat_timeout: float | None = 120.0, startup_timeout: float = 300.0):
        if num_workers < 1:
            raise ValueError(f"RayExecutor needs at least one worker, got num_workers={num_workers}")
        if not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
        if num_cpus < 0 or num_gpus < 0:
            raise ValueError(f"num_cpus and num_gpus must be >= 0, got {num_cpus}, {num_gpus}")
        if heartbeat_timeout is not None and heartbeat_timeout <= poll_wait:
            raise ValueError(f"heartbeat_timeout ({heartbeat_timeout}) must exceed poll_wait "
                             f"({poll_wait}): an idle actor answers only every poll_wait s")
        self.heartbeat_timeout, self.startup_timeout = heartbeat_timeout, startup_timeout
        self.num_slots, self.ranks = num_workers, ranks
        self.address, self.num_cpus, self.num_gpus = address, num_cpus, num_gpus
        self.resources, self.runtime_env, self.poll_wait = resources, runtime_env, poll_wait
        self.threads = threads_per_worker or max(1, int(num_cpus))
        self.shared_storage = shared_storage if shared_storage is not None else address is None
        self._slots = [_Slot(i) for i in range(num_workers)]
        self._pending: collections.deque[Job] = collections.deque()
        self._events: collections.deque[Event] = collections.deque()
        self._refs: dict[Any, tuple[_Slot, str, Any]] = {}  # outstanding call -> (slot, kind, actor)
        self._uses = 0
        self._started = self._closed = False
        self._owns_ray = False  # this executor called ray.init: close() calls ray.shutdown()
        self._temp_dir: str | None = None
        self._broken: str | None = None
        self._actor_class: Any = None
        # group name prefixes of killed actors (the latest): their groups are removed
        self._orphans: collections.deque[str] = collections.deque(maxlen=4 * num_workers)

    # ---- the Executor interface ---------------------------------------------------------

    def submit(self, job: Job) -> None:
        if self._closed:
            raise RuntimeError("RayExecutor.submit after close(); create a new executor")
        running = {s.job.job_id for s in self._slots if s.job is not None}
        if job.job_id in running or any(j.job_id == job.job_id for j in self._pending):
            raise ValueError(f"job {job.job_id!r} is already submitted; job ids must be unique")
        self._start()
        self._collect()  # an idle actor Ray already knows is dead gets no job: it is replaced
        self._pending.append(job)
        self._dispatch()

    def next_event(self, timeout: float | None = None) -> Event | None:
        """The next event; None after ``timeout`` s, or at once when no job is queued or
        running (nothing could ever come)."""
        self._start()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._events:
                if self._broken is not None:
                    raise EnvironmentFailure(self._broken)
                if not self._pending and all(s.job is None for s in self._slots):
                    return None
                left = _WAIT_SLICE if deadline is None else deadline - time.monotonic()
                ready, _ = ray.wait(list(self._refs), num_returns=1,
                                    timeout=max(0.0, min(left, self._until_deadline())))
                for ref in ready:
                    self._handle(ref)
                self._check_health()
                if not self._events and deadline is not None and time.monotonic() >= deadline:
                    return None
        except KeyboardInterrupt:
            self.close()
            raise
        return self._events.popleft()

    def cancel(self, job_id: str) -> None:
        """Drop a queued job, or kill the actor running it (and start a replacement). Either
        way the job ends with ``JobFailed(error="cancelled")``, and no other event of it
        follows, not even one already received. Unknown or ended jobs: no-op."""
        for job in self._pending:
            if job.job_id == job_id:
                self._pending.remove(job)
                self._events.append(JobFailed(job_id, None, "cancelled"))
                return
        for slot in self._slots:
            if slot.job is not None and slot.job.job_id == job_id:
                self._events = collections.deque(e for e in self._events if e.job_id != job_id)
                self._events.append(JobFailed(job_id, None, "cancelled"))
                slot.job = None
                self._replace(slot)
                self._dispatch()
                return

    def close(self) -> None:
        """Kill every actor; shut down the Ray instance if this executor started or joined it."""
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        if self._started and ray.is_initialized():
            for slot in self._slots:
                if slot.actor is not None:
                    _kill(slot.actor)
                    slot.actor = None
                    self._orphans.append(slot.groups)
            self._refs.clear()
            self._remove_orphans()
            if self._owns_ray:
                ray.shutdown()
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
        atexit.unregister(self.close)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every slot's actor is up (imports done), e.g. before timing a run;
        False on timeout. Raises :class:`EnvironmentFailure` as :meth:`next_event` does."""
        self._start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(s.ready for s in self._slots):
            if self._broken is not None or self._closed:
                return True  # nothing more will start; next_event says why
            starting = [r for r, (_, kind, _) in self._refs.items() if kind == "ready"]
            left = _WAIT_SLICE if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _ = ray.wait(starting, num_returns=1,
                                timeout=max(0.0, min(left, self._until_deadline())))
            for ref in ready:
                self._handle(ref)
            self._check_health()
        return True

    def worker_pids(self) -> dict[str, int | None]:
        """The process id of every slot's current actor, None while it starts (for tests and
        diagnostics; on a cluster the pid is on the actor's node, :meth:`worker_nodes`)."""
        return {s.name: s.pid for s in self._slots}

    def worker_nodes(self) -> dict[str, str | None]:
        """The Ray node id of every slot's current actor (None while it starts)."""
        return {s.name: s.node for s in self._slots}

    # ---- actors -------------------------------------------------------------------------------

    def _start(self) -> None:
        """Connect to (or start) Ray and create the actors, once."""
        if self._started:
            return
        if self._closed:
            raise RuntimeError("RayExecutor used after close(); create a new executor")
        self._started = True
        job_env, actor_env = split_runtime_env(self.runtime_env)
        if self.address is not None:
            # a local folder (the space file's, docs/ray.md) travels as the job's working_dir:
            # Ray uploads it at ray.init; an actor's options may name only URIs
            ray.init(address=self.address, **({"runtime_env": job_env} if job_env else {}))
            self._owns_ray = True
        elif not ray.is_initialized():
            # each slot, and the K rank actors of a ranked segment it runs
            per_slot = self.num_cpus * (1 + (self.ranks if self.ranks > 1 else 0))
            cpus = max(os.cpu_count() or 1, math.ceil(self.num_slots * per_slot))
            self._temp_dir = start_local_ray(num_cpus=cpus)
            self._owns_ray = True
        atexit.register(self.close)
        self._check_resources()
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                                   "max_concurrency": 2, "max_restarts": 0,
                                   "max_task_retries": 0}
        if self.resources:
            options["resources"] = self.resources
        if actor_env:  # (a private local instance reads the folder where it is)
            options["runtime_env"] = actor_env
        self._actor_class = ray.remote(WorkerActor).options(**options)
        for slot in self._slots:
            self._create(slot)

    def _check_resources(self) -> None:
        """A slot the cluster can never hold would wait forever: say so now. (An autoscaling
        cluster may add what is missing, so there it is a warning.)"""
        total = ray.cluster_resources()
        need = {"CPU": self.num_cpus, "GPU": self.num_gpus, **(self.resources or {})}
        short = {k: (v, total.get(k, 0.0)) for k, v in need.items() if v > total.get(k, 0.0)}
        ranked = {k: v * (1 + self.ranks) for k, v in (("CPU", self.num_cpus),
                                                         ("GPU", self.num_gpus)) if v > 0}
        if self.ranks > 1 and not short and any(v > total.get(k, 0.0) for k, v in ranked.items()):
            _log.warning("RayExecutor: a segment on %d ranks needs a slot and %d bundles of it "
                         "(%s in all); the cluster has %s: its placement group waits, then fails "
                         "(PlacementError)", self.ranks, self.ranks, ranked,
                         {k: total.get(k, 0.0) for k in ranked})
        if not short:
            return
        what = ", ".join(f"{k}: a slot needs {v}, the cluster has {h}" for k, (v, h) in short.items())
        if self._owns_ray and self.address is None:
            self.close()
            raise ValueError(f"RayExecutor: the local Ray instance cannot hold one slot ({what}); "
                             "lower num_cpus/num_gpus/resources")
        _log.warning("RayExecutor: the cluster cannot hold one slot now (%s); its actors wait "
                     "until the cluster grows", what)

    def _create(self, slot: _Slot) -> None:
        # On this machine the driver's sys.path is the actors' too; a cluster's nodes have
        # their own (code reaches them installed, or by runtime_env).
        sys_path = sys.path if self.address is None else []
        slot.groups = f"retiarii-ranks-{uuid.uuid4().hex[:12]}-"
        ranks = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                 "runtime_env": self.runtime_env, "group_prefix": slot.groups}
        slot.actor = self._actor_class.remote(slot.name, self.threads, list(sys_path), ranks)
        slot.ready, slot.pid, slot.node, slot.job, slot.run_ref = False, None, None, None, None
        slot.beat, slot.start_warned = time.monotonic(), False
        self._refs[slot.actor.ready.remote()] = (slot, "ready", slot.actor)

    def _replace(self, slot: _Slot) -> None:
        """Kill the slot's actor (whatever it is doing) and start a new one."""
        for ref in [r for r, (s, _, _) in self._refs.items() if s is slot]:
            del self._refs[ref]
        _kill(slot.actor)
        self._orphans.append(slot.groups)
        self._remove_orphans()
        self._create(slot)

    def _remove_orphans(self) -> None:
        """Remove the placement groups of ranked segments whose worker actor was killed (its
        rank actors died with it; the groups would hold their resources until the driver
        exits). Each prefix stays listed for the next few kills: ``ray.kill`` is
        asynchronous, so a dying actor may still create a group after the first sweep."""
        from .ray_ranks import remove_groups

        remove_groups(*self._orphans)

    def _dispatch(self) -> None:
        """Hand queued jobs to ready idle slots: the one ``job.meta["worker"]`` names if it is
        idle (the runner's hint to continue a trial where it ran), else the least recently used."""
        idle = sorted((s for s in self._slots if s.ready and s.job is None),
                      key=lambda s: s.last_used)
        while self._pending and idle:
            job = self._pending.popleft()
            slot = pick_slot(idle, job)
            idle.remove(slot)
            self._uses += 1
            slot.job, slot.last_used = job, self._uses
            blobs = None if self.shared_storage else read_inputs(job)
            slot.run_ref = slot.actor.run.remote(job, blobs)  # its events call is outstanding

    def _collect(self) -> None:
        """Handle every call that has already returned, without waiting."""
        if self._refs:
            done, _ = ray.wait(list(self._refs), num_returns=len(self._refs), timeout=0)
            for ref in done:
                self._handle(ref)

    def _poll(self, slot: _Slot) -> None:
        self._refs[slot.actor.events.remote(self.poll_wait)] = (slot, "events", slot.actor)

    # ---- what comes back ----------------------------------------------------------------------

    def _handle(self, ref: Any) -> None:
        slot, kind, actor = self._refs.pop(ref)
        if slot.actor is not actor:
            return  # an answer from an actor already replaced
        try:
            value = ray.get(ref, timeout=0)
        except ActorUnavailableError:
            # unreachable, maybe for a moment (its node may be dying: the GCS takes ~15 s to
            # say): ask again; the heartbeat deadline bounds how long (ray_health)
            if kind == "ready":
                self._refs[actor.ready.remote()] = (slot, "ready", actor)
            else:
                self._poll(slot)
            return
        except RayActorError as err:  # died: the slot is lost, or with it the whole cluster
            ray_health.check_cluster(f"worker {slot.name} was lost ({_first_line(err)})")
            self._lost(slot, err)
            return
        except RayError as err:  # the call itself failed (e.g. the actor's __init__ raised)
            self._lost(slot, err)
            return
        slot.beat = time.monotonic()
        if kind == "ready":
            slot.ready, slot.failed_starts = True, 0
            slot.pid, slot.node = value
            self._poll(slot)
            self._dispatch()
            return
        for event, data in value:
            if slot.job is None or event.job_id != slot.job.job_id:
                continue
            if data is not None:  # transfer mode: the checkpoint lands in the driver's run dir
                write_atomically(event.path, data)
            self._events.append(event)
            if isinstance(event, (JobFinished, JobFailed)):
                slot.job, slot.run_ref = None, None
        self._poll(slot)  # busy or idle: one events call per live actor, always
        if slot.job is None:
            self._dispatch()

    def _until_deadline(self) -> float:
        """Seconds the next wait may last: up to the next health deadline (ray_health)."""
        at = ray_health.next_deadline(self._slots, self.heartbeat_timeout, self.startup_timeout)
        return _WAIT_SLICE if at is None else min(_WAIT_SLICE, max(0.0, at - time.monotonic()))

    def _check_health(self) -> None:
        """Kill hung actors (their jobs are retried); raise :class:`EnvironmentFailure` when
        no slot could start in time (:mod:`.ray_health`)."""
        late = ray_health.overdue(self._slots, time.monotonic(), self.heartbeat_timeout,
                                  self.startup_timeout)
        for slot, kind in late:
            if kind == "hung":
                ray_health.check_cluster(f"worker {slot.name} stopped answering")
                self._lost(slot, f"stopped answering for {self.heartbeat_timeout:g} s (hung, "
                                 "stopped, or its node unreachable) and was killed")
        if any(kind == "start" for _, kind in late):
            if not any(s.ready for s in self._slots):
                ray_health.check_cluster("no worker actor is ready")
                need = {"CPU": self.num_cpus, "GPU": self.num_gpus, **(self.resources or {})}
                raise EnvironmentFailure(ray_health.unplaceable(need, self.startup_timeout))
            for slot in (slot for slot, kind in late if kind == "start"):
                slot.start_warned = True
                _log.warning("RayExecutor: worker %s is not ready %g s after its creation (no "
                             "node has room for it, or its imports hang); the search goes on "
                             "with the other slots", slot.name, self.startup_timeout)

    def _lost(self, slot: _Slot, err: BaseException | str) -> None:
        job, was_ready = slot.job, slot.ready
        why = err if isinstance(err, str) else _first_line(err)
        where = f"worker {slot.name} (pid {slot.pid}, node {slot.node})" if was_ready \
            else f"worker {slot.name} (starting)"
        if job is not None:
            self._events.append(JobFailed(
                job.job_id, None, f"{where} was lost: {why}; its trials resume from "
                "their last checkpoints", worker_lost=True))
        slot.job = None
        if not was_ready:
            slot.failed_starts += 1
            if slot.failed_starts >= 3:
                self._broken = (f"worker {slot.name} failed to start 3 times in a row (last: "
                                f"{why}); check that retiarii and torch import on "
                                "the Ray nodes (installed there, or runtime_env=)")
                return
        self._replace(slot)
        self._dispatch()
