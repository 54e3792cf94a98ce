"""Warm worker starts: one forkserver per driver process, preloaded with torch and retiarii,
forks every local worker, so a worker start costs a fork instead of ``import retiarii``.

A spawned worker is a fresh interpreter that imports torch, retiarii and ``torch._dynamo``
(the first optimizer pulls it in) before it can train: seconds of CPU per start, paid again
by every replacement of a lost worker and by every executor a process makes. Python's
*forkserver* start method keeps one clean server process, started once per driver process,
and forks each child from it. The server imports only :data:`PRELOAD` (never the driver's
``__main__``: the user's script and space files are imported by each child as under spawn,
so a space file written after the server started is found). It runs no torch code, so it
holds no CUDA context, no thread pool and none of the driver's threads or open files: what
makes a plain ``fork`` of the driver unsafe on a GPU machine does not apply.

Under spawn the child's environment is the driver's at :meth:`start`; a forked child inherits
the server's instead (the driver's when the server started). :func:`in_environment` makes the
two alike: the child takes the driver's environment of the moment, plus the slot's
``CUDA_VISIBLE_DEVICES`` and thread counts, before the worker runs (CUDA reads its variables
when it starts, later, in the worker). Variables that torch reads while it is imported are
the server's: set them before the first executor starts (or the first ``Experiment`` with
local workers is made: :func:`start_server_for`).

When the forkserver method does not exist (Windows), or it was started before this module
set its preload (by other code of the process), workers are still correct: spawned, or
forked from a server without the preload.

Example::

    ctx = worker_context()                      # the forkserver context, preloaded
    p = ctx.Process(target=in_environment, args=(env, body, *args))
"""
from __future__ import annotations

import multiprocessing as mp
import signal
from multiprocessing import forkserver, resource_tracker
import os
from typing import Any, Callable

__all__ = ["PRELOAD", "in_environment", "start_server_for", "worker_context"]

# What every worker imports before its first job: torch, retiarii (package, engine, worker),
# torch._dynamo, which the first optimizer imports (~2 s of CPU alone), and the grouped job's
# modules (layouts, the device model, measuring), which the worker imports at its first
# grouped job: 25-35 ms of every worker's first job here, paid once in the server instead.
PRELOAD = ["torch", "torch._dynamo", "retiarii", "retiarii.engine.worker_side.worker",
           "retiarii.engine.executors.local", "retiarii.engine.worker_side.group_layouts",
           "retiarii.engine.worker_side.fused_undo"]


def worker_context(method: str = "forkserver") -> Any:
    """The multiprocessing context that starts workers: ``"forkserver"`` (preloaded with
    :data:`PRELOAD`, the server started now if it is not running; spawn where the platform
    has no forkserver) or ``"spawn"``.

    Example::

        worker_context("spawn").Process(target=f).start()
    """
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method={method!r}: give 'forkserver' (workers forked from a "
                         "preloaded server, the default) or 'spawn' (a fresh interpreter each)")
    if method == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Global to the process and read when the server starts: setting it again is harmless,
    # and a server already running (started by other code) keeps its own list.
    ctx.set_forkserver_preload(PRELOAD)
    # Started now, not by the first worker's start(), which runs with that slot's variables
    # in os.environ: the server would keep them (its children get theirs anyway). SIGINT is
    # blocked while it starts (the mask survives its exec): Python's server ignores Ctrl-C only
    # after its preload, so a Ctrl-C during those seconds printed its traceback into the
    # user's terminal. Workers ignore SIGINT themselves (local.py): Ctrl-C is the driver's.
    # multiprocessing's resource tracker is started first, on its own: its start *unblocks*
    # SIGINT when done (it does not restore the mask it found), which left the server's exec
    # open to a Ctrl-C when both started inside our block. The mask is the calling thread's,
    # so it is set whichever thread starts the server.
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return ctx


def in_environment(env: dict[str, str], body: Callable[..., None], *args: Any) -> None:
    """Run ``body(*args)`` in a worker process with exactly the environment ``env`` (module
    level, so both start methods find it).

    A forked child ends with ``os._exit`` once ``body`` returns (after multiprocessing's own
    exit handlers and a flush of the standard streams): it skips the interpreter's teardown,
    which frees torch's and dynamo's modules and took seconds of every ``close()`` under spawn.
    """
    os.environ.clear()
    os.environ.update(env)
    body(*args)


def start_server_for(executor: Any) -> None:
    """Start the workers' server now when a search will use local workers (``executor``
    None or ``"local"``): it imports :data:`PRELOAD` in its own process (seconds of CPU) while
    the driver makes its store, strategy and first proposals, instead of after them, when the
    first worker starts (issue #26 item 4, fixed costs). Nothing else is started."""
    if executor is None or executor == "local":
        worker_context()
