"""The body of a LocalExecutor worker process: heartbeats, jobs one at a time, cancels.

What the driver's side (:mod:`.local`) talks to over two pipes: it receives ``Job``, ``("cancel",
job_id)`` or ``None`` (stop), and sends ``("ready", pid)``, ``("hb",)`` and ``("event",
event)``.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Any

from ...determinism import prepare_worker
from ..jobs.job import Job

__all__ = ["worker_main"]


def worker_main(name: str, jobs_in, events_out, heartbeat_interval: float, threads: int) -> None:
    """The body of a worker process (module level, so spawn can find it): heartbeats every
    ``heartbeat_interval`` s, then ``("ready", pid)``, then the jobs ``jobs_in`` hands it, one at
    a time, their events sent on ``events_out``, until ``None`` (or the pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    send_lock, stop = threading.Lock(), threading.Event()

    def send(message: Any) -> None:
        with send_lock:  # the heartbeat thread and the job loop share the pipe
            events_out.send(message)

    def beat() -> None:
        while not stop.wait(heartbeat_interval):
            try:
                send(("hb",))
            except OSError:  # the driver is gone: nobody will ever read our results
                os._exit(1)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()
    prepare_worker()  # before CUDA starts: any job of this worker may be deterministic
    import torch

    torch.set_num_threads(threads)
    # The first optimizer imports torch._dynamo (~2 s): pay that before saying we are ready.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    from ..worker_side.worker import WorkerContext, run_job

    context = WorkerContext()
    try:
        send(("ready", os.getpid()))
        while True:
            job = jobs_in.recv()
            if job is None:
                break
            if not isinstance(job, Job):
                continue  # a cancel that arrived after its job ended
            inbox = _Inbox(jobs_in, job.job_id)
            run_job(job, lambda event: send(("event", event)), worker=name, context=context,
                    cancelled=inbox.cancelled)
            if inbox.closing:
                break
    except (EOFError, OSError):
        pass  # the driver closed our pipes: exit quietly
    finally:
        stop.set()


class _Inbox:
    """What the driver said while a job ran: read between steps, never waited on."""

    def __init__(self, jobs_in, job_id: str):
        self.jobs_in, self.job_id = jobs_in, job_id
        self.cancel = self.closing = False

    def cancelled(self) -> bool:
        while not self.cancel and self.jobs_in.poll():
            message = self.jobs_in.recv()
            if message is None:
                self.cancel = self.closing = True
            elif message == ("cancel", self.job_id):
                self.cancel = True
        return self.cancel
