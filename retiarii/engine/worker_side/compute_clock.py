"""The clock that times a layout's compute in a worker: CPU time where the machine's other work
would otherwise be counted, wall time where it cannot be.

A grouped job compares its steps with each model's steps alone, measured at other moments. On
a CPU worker with one torch thread (the default with one worker per core), wall time counts
whatever else the core did meanwhile: the other worker, a data loader, the driver, another
user's job. Two segments of one layout then measured 1.0x and 0.6x on a loaded machine, and a
busy neighbour could revert a layout that was faster. The CPU time of the worker's process
counts its own work only, so a neighbour changes it little (what it shares: caches, memory
bandwidth). With several torch threads the process's CPU time adds every thread's, which says
nothing of how well a larger merged call parallelizes, and on a GPU the work is the device's:
both use wall time (after a synchronize).

Example::

    clock = compute_clock(run.device)
    t0 = clock(); step(); seconds = clock() - t0
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

__all__ = ["compute_clock"]


def compute_clock(device: Any) -> Callable[[], float]:
    """``time.process_time`` on a CPU device with one torch thread, else ``time.perf_counter``."""
    if torch.device(device).type == "cpu" and torch.get_num_threads() == 1:
        return time.process_time
    return time.perf_counter
