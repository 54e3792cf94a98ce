"""LocalExecutor: a pool of worker processes on this machine, one slot per GPU or CPU share.

Each slot is one process, forked from a server preloaded with torch and retiarii
(:mod:`.warm`: no forked CUDA or thread state, no ``import retiarii`` per start) or spawned,
with ``CUDA_VISIBLE_DEVICES`` naming its GPU (empty on a CPU-only slot) and its thread pools
sized to its share of the cores, both set in its environment before it imports torch. A worker
runs :func:`retiarii.engine.worker_side.worker.run_job` on the jobs it is handed
(:mod:`.local_worker`), so it rebuilds every model from the trial's spec; models never travel
pickled.

One thread in the driver (the *pump*) blocks in :func:`multiprocessing.connection.wait` on every
worker's event pipe and process sentinel at once, and turns what it reads into events on a queue
that :meth:`LocalExecutor.next_event` blocks on. Nothing sleeps and polls:

- a message wakes the pump, which queues the event and, when a job ends, hands the next queued
  job to an idle, ready slot: the one its ``meta["worker"]`` names if that one is idle (the
  runner's hint to continue a trial where it ran), else the least recently used;
- a worker that dies (a segfault, the OOM killer, SIGKILL) makes its sentinel ready; the pump
  reports ``JobFailed(worker_lost=True)`` for its job and starts a replacement;
- a worker whose heartbeats stop (hung with the GIL held, stopped) is killed when its deadline
  passes (the pump's wait times out exactly then) and is handled as a death;
- a cancel is a message the worker reads between steps; it ends the job there, keeping the
  worker warm. One that does not stop within a grace period is killed like a silent one.

Ctrl-C: workers ignore SIGINT, so the driver decides; an interrupted :meth:`next_event` closes
the executor before re-raising, and :meth:`close` ends the children (idle ones cleanly).
Scripts that create an executor need the usual ``if __name__ == "__main__":`` guard of spawn.
"""
from __future__ import annotations

import atexit
import collections
import itertools
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
from typing import Any, Sequence

from ..errors import EnvironmentFailure, main_guard_hint
from ..jobs.job import Event, Executor, Job, JobFailed, JobFinished, pick_slot
from .local_worker import worker_main
from .warm import in_environment, worker_context

__all__ = ["LocalExecutor", "visible_gpus"]

_ENV_LOCK = threading.Lock()  # os.environ is process-wide: children start one at a time
_BROKEN = object()  # queued when a slot cannot start; next_event raises


def visible_gpus() -> list[str]:
    """The GPUs this process may use, named as a worker's ``CUDA_VISIBLE_DEVICES`` takes them:
    this process's own list when it has one (a worker told "0" would otherwise use the
    machine's first GPU, not this process's first), else ``0 .. count - 1``.

    Example::

        visible_gpus()   # CUDA_VISIBLE_DEVICES=2,3 on a 4-GPU machine: ["2", "3"]
    """
    import torch

    count = torch.cuda.device_count()
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is None:
        return [str(i) for i in range(count)]
    # CUDA stops reading the list at its first invalid entry: the first `count` are the GPUs.
    return [name.strip() for name in inherited.split(",") if name.strip()][:count]


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Slot:
    """One worker process and what the driver knows about it."""

    def __init__(self, index: int, device: str | None):
        self.name = f"local-{index}"
        self.device = device  # CUDA_VISIBLE_DEVICES value; "" on a CPU slot
        self.process: Any = None
        self.jobs_out: Any = None  # driver -> worker: Job, or None to stop
        self.events_in: Any = None  # worker -> driver: ("ready"|"hb"|"event", ...)
        self.job: Job | None = None
        self.ready = False
        self.last_beat = 0.0
        self.last_used = 0  # dispatch order: the least recently used idle slot goes first
        self.cancelled = False  # its job was cancelled: what follows reports "cancelled"
        self.cancel_deadline: float | None = None  # killed if the job has not ended by then
        self.killed_for: str | None = None  # why the driver killed it (a deadline passed)
        self.failed_starts = 0


class LocalExecutor(Executor):
    """Runs jobs on a pool of local worker processes.

    Example::

        with LocalExecutor(num_workers=2) as ex:
            ex.submit(Job("j1", [TrialTask("t1", spec, 0, 2, None, "runs/ckpt/t1-2.pt")]))
            while not isinstance(event := ex.next_event(), (JobFinished, JobFailed)):
                print(event)

    Args:
        num_workers: slots. Default: one per device in ``devices``, or one per CPU core when
            there is no GPU. More workers than GPUs share them round-robin.
        devices: GPU ids for ``CUDA_VISIBLE_DEVICES``, as this machine names them. Default:
            every GPU this process sees (:func:`visible_gpus`); ``[]`` forces CPU-only workers.
        threads_per_worker: torch threads in each worker. Default: cores // num_workers (at
            least 1), so the workers together use the machine without oversubscribing it.
        heartbeat_interval: seconds between a worker's heartbeats.
        heartbeat_timeout: a worker silent this long is killed and reported lost (None: never).
            Generous by default: one heartbeat thread keeps beating through long epochs.
        startup_timeout: a worker not ready this long after its start is killed (importing
            torch in a fresh process takes seconds, on a loaded machine far more).
        cancel_grace: seconds a cancelled job has to reach its next step boundary before its
            worker is killed (and replaced); a step longer than this costs a worker restart.
        start_method: ``"forkserver"`` (default): workers fork from one server per process
            that imported torch and retiarii once (:mod:`.warm`); ``"spawn"``: each worker
            is a fresh interpreter that imports them itself (seconds per start).
    """

    @classmethod
    def for_search(cls, workers: int, devices=None, *, one_shot: bool = False, ranks: int = 1,
                   **options) -> "LocalExecutor":
        """The executor an Experiment makes for its search (the registry's ``"local"``)."""
        if not one_shot:
            return cls(workers, devices, **options)
        # a one-shot search runs one segment at a time: one worker does it all, seeing a GPU
        # per rank when there are enough (its ranks then use NCCL)
        if ranks > 1:
            gpus = [str(d) for d in (devices if devices is not None else visible_gpus())]
            if len(gpus) >= ranks:
                devices = [",".join(gpus[:ranks])]
        return cls(1, devices, **options)

    def __init__(self, num_workers: int | None = None, devices: Sequence[int | str] | None = None, *,
                 threads_per_worker: int | None = None, heartbeat_interval: float = 2.0,
                 heartbeat_timeout: float | None = 120.0, startup_timeout: float = 300.0,
                 cancel_grace: float = 30.0, start_method: str = "forkserver"):
        if devices is None:
            devices = visible_gpus()
        self.devices = [str(d) for d in devices]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if num_workers is None:
            num_workers = len(self.devices) or cores or 1
        if num_workers < 1:
            raise ValueError(f"LocalExecutor needs at least one worker, got num_workers={num_workers}")
        self.num_slots = num_workers
        self.threads = threads_per_worker or max(1, (cores or 1) // num_workers)
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_timeout = startup_timeout
        self.cancel_grace = cancel_grace
        self._ctx = worker_context(start_method)
        self._lock = threading.RLock()
        self._ready = threading.Condition(self._lock)  # notified when a worker becomes ready
        self._events: queue.Queue = queue.Queue()
        self._pending: collections.deque[Job] = collections.deque()
        self._running: dict[str, _Slot] = {}
        self._uses = itertools.count(1)
        self._closed = False
        self._broken: str | None = None
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._slots = [_Slot(i, self.devices[i % len(self.devices)] if self.devices else "")
                       for i in range(num_workers)]
        for slot in self._slots:
            self._start(slot)
        self._pump = threading.Thread(target=self._pump_loop, name="retiarii-local-executor",
                                      daemon=True)
        self._pump.start()
        atexit.register(self.close)

    # ---- the Executor interface ---------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("LocalExecutor.submit after close(); create a new executor")
            if job.job_id in self._running or any(j.job_id == job.job_id for j in self._pending):
                raise ValueError(f"job {job.job_id!r} is already submitted; job ids must be unique")
            self._pending.append(job)
            self._dispatch()

    def next_event(self, timeout: float | None = None) -> Event | None:
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        except KeyboardInterrupt:
            self.close()
            raise
        if event is _BROKEN:
            self._events.put(_BROKEN)  # every later call fails the same way
            raise EnvironmentFailure(self._broken)
        return event

    def cancel(self, job_id: str) -> None:
        """Drop a queued job, or stop a running one at its next step boundary (a worker that
        does not stop within ``cancel_grace`` seconds is killed and replaced). Either way the
        job ends with ``JobFailed(error="cancelled")``; later events of it are dropped.
        Unknown or ended jobs: no-op."""
        with self._lock:
            for job in self._pending:
                if job.job_id == job_id:
                    self._pending.remove(job)
                    self._events.put(JobFailed(job_id, None, "cancelled"))
                    return
            slot = self._running.get(job_id)
            if slot is not None and not slot.cancelled:
                slot.cancelled = True
                slot.cancel_deadline = time.monotonic() + self.cancel_grace
                try:
                    slot.jobs_out.send(("cancel", job_id))
                except OSError:
                    pass  # it died; the sentinel reports the job, as cancelled
                self._wake_w.send_bytes(b"x")  # the pump's next deadline moved

    def close(self) -> None:
        """Stop every worker: idle ones are asked to exit, busy or starting ones terminated."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ready.notify_all()
            self._pending.clear()
            for slot in self._slots:
                if slot.process is None:
                    continue
                if slot.job is None and slot.ready:
                    try:
                        slot.jobs_out.send(None)
                    except OSError:
                        pass
                else:
                    slot.process.terminate()
            self._wake_w.send_bytes(b"x")
        self._pump.join()
        for slot in self._slots:
            if slot.process is None:
                continue
            slot.process.join(timeout=5)
            if slot.process.is_alive():
                slot.process.kill()
                slot.process.join()
            slot.jobs_out.close()
            slot.events_in.close()
        self._wake_r.close()
        self._wake_w.close()
        atexit.unregister(self.close)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every worker has started (imports done), e.g. before timing a run;
        False on timeout."""
        with self._ready:
            return self._ready.wait_for(
                lambda: self._closed or self._broken is not None or all(s.ready for s in self._slots),
                timeout)

    def slot_memory(self) -> float:
        """Bytes each slot lends to models: a GPU slot its GPU's memory shared by the slots
        on that GPU; a CPU slot the machine's memory shared by every slot (a CPU-only
        machine's devices are its worker slots)."""
        if self.devices:
            import torch

            if torch.cuda.is_available():
                visible = visible_gpus()
                sizes = []
                for slot in self._slots:
                    sharing = sum(1 for s in self._slots if s.device == slot.device)
                    index = visible.index(slot.device) if slot.device in visible else 0
                    sizes.append(torch.cuda.get_device_properties(index).total_memory / sharing)
                return min(sizes)
        pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else -1
        if pages <= 0:
            return float("inf")
        return pages * os.sysconf("SC_PAGE_SIZE") / self.num_slots

    def worker_pids(self) -> dict[str, int | None]:
        """The process id of every slot's current worker (for tests and diagnostics)."""
        with self._lock:
            return {s.name: (s.process.pid if s.process is not None else None) for s in self._slots}

    # ---- slots ------------------------------------------------------------------------------

    def _start(self, slot: _Slot) -> None:
        jobs_in, slot.jobs_out = self._ctx.Pipe(duplex=False)
        slot.events_in, events_out = self._ctx.Pipe(duplex=False)
        # The child reads these before importing torch: CUDA and the thread pools see them.
        env = {"CUDA_VISIBLE_DEVICES": slot.device, "OMP_NUM_THREADS": str(self.threads),
               "MKL_NUM_THREADS": str(self.threads)}
        with _ENV_LOCK:
            saved = {key: os.environ.get(key) for key in env}
            os.environ.update(env)
            # A forked child would inherit the server's environment: it is given ours.
            slot.process = self._ctx.Process(
                target=in_environment, name=f"retiarii-{slot.name}",
                args=(dict(os.environ), worker_main, slot.name, jobs_in, events_out,
                      self.heartbeat_interval, self.threads))
            try:
                slot.process.start()
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
        jobs_in.close()  # the child holds its own copies; ours would hide its death from recv
        events_out.close()
        slot.ready, slot.cancelled, slot.cancel_deadline, slot.killed_for = False, False, None, None
        slot.last_beat = time.monotonic()

    def _dispatch(self) -> None:
        """Hand queued jobs to idle slots, least recently used first. Caller holds the lock."""
        # Only ready slots: a job handed to a worker still starting would wait behind its
        # imports while another slot may free up sooner.
        idle = sorted((s for s in self._slots if s.ready and s.job is None),
                      key=lambda s: s.last_used)
        while self._pending and idle:
            job = self._pending.popleft()
            slot = pick_slot(idle, job)
            idle.remove(slot)
            slot.job, slot.last_used = job, next(self._uses)
            self._running[job.job_id] = slot
            try:
                slot.jobs_out.send(job)
            except OSError:
                pass  # the worker just died; its sentinel reports the job as lost

    # ---- the pump ---------------------------------------------------------------------------

    def _pump_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                owners: dict[Any, tuple[_Slot, Any]] = {}
                for slot in self._slots:
                    if slot.process is not None:
                        owners[slot.events_in] = (slot, slot.process)
                        owners[slot.process.sentinel] = (slot, slot.process)
                deadline = self._next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = mp.connection.wait([*owners, self._wake_r], timeout)
            with self._lock:
                if self._closed:
                    return
                for obj in ready:
                    if obj is self._wake_r:
                        while self._wake_r.poll():
                            self._wake_r.recv_bytes()
                        continue
                    slot, process = owners[obj]
                    if slot.process is not process:
                        continue  # that worker was already replaced
                    if obj is slot.events_in:
                        self._receive(slot)
                    else:
                        self._on_death(slot)
                self._kill_stale()

    def _deadlines(self, slot: _Slot) -> list[tuple[float, str]]:
        """(time, why) pairs after which ``slot``'s worker gets killed."""
        if slot.process is None or slot.killed_for is not None:
            return []
        out = []
        if not slot.ready:
            out.append((slot.last_beat + self.startup_timeout,
                        f"was not ready {self.startup_timeout} s after starting"))
        elif self.heartbeat_timeout is not None:
            out.append((slot.last_beat + self.heartbeat_timeout,
                        f"stopped sending heartbeats for {self.heartbeat_timeout} s"))
        if slot.cancel_deadline is not None:
            out.append((slot.cancel_deadline, f"did not stop within {self.cancel_grace} s of "
                                              "a cancel"))
        return out

    def _next_deadline(self) -> float | None:
        return min((d for s in self._slots for d, _ in self._deadlines(s)), default=None)

    def _kill_stale(self) -> None:
        now = time.monotonic()
        for slot in self._slots:
            for deadline, why in self._deadlines(slot):
                if now >= deadline:
                    slot.killed_for = f"{why} and was killed"
                    slot.process.kill()  # its sentinel brings us to _on_death
                    break

    def _receive(self, slot: _Slot) -> bool:
        """Handle one message; False when the pipe is at its end (the worker died)."""
        try:
            message = slot.events_in.recv()
        except (EOFError, OSError):
            return False  # it died; the sentinel tells
        slot.last_beat = time.monotonic()
        kind = message[0]
        if kind == "ready":
            slot.ready, slot.failed_starts = True, 0
            self._ready.notify_all()
            self._dispatch()
        elif kind == "event":
            self._on_event(slot, message[1])
        return True

    def _on_event(self, slot: _Slot, event: Event) -> None:
        if slot.job is None or event.job_id != slot.job.job_id:
            return
        terminal = isinstance(event, (JobFinished, JobFailed))
        if slot.cancelled:  # the engine has let go of this job: only its end is news
            if not terminal:
                return
            event = JobFailed(event.job_id, None, "cancelled")
        self._events.put(event)
        if terminal:
            del self._running[slot.job.job_id]
            slot.job, slot.cancelled, slot.cancel_deadline = None, False, None
            self._dispatch()

    def _on_death(self, slot: _Slot) -> None:
        while True:  # what it said before dying still counts (results, even its last event)
            try:
                if not slot.events_in.poll() or not self._receive(slot):
                    break
            except (EOFError, OSError):
                break
        process, job = slot.process, slot.job
        process.join()
        cause = slot.killed_for or _describe_exit(process.exitcode)
        if job is not None:
            del self._running[job.job_id]
            slot.job = None
            if slot.cancelled:
                self._events.put(JobFailed(job.job_id, None, "cancelled"))
            else:
                self._events.put(JobFailed(
                    job.job_id, None, f"worker {slot.name} (pid {process.pid}) {cause}; "
                    "its trials resume from their last checkpoints", worker_lost=True))
        slot.failed_starts += 0 if slot.ready else 1
        slot.jobs_out.close()
        slot.events_in.close()
        slot.process = None
        if slot.failed_starts >= 3:
            self._broken = (f"worker {slot.name} failed to start 3 times in a row (last: {cause}); "
                            f"check that retiarii and torch import in a fresh python process"
                            f"{main_guard_hint()}")
            self._events.put(_BROKEN)
            self._ready.notify_all()
            return
        self._start(slot)
        self._dispatch()
