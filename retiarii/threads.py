"""Small torch work in a process that shares its cores with busy workers, on one thread.

The driver of a search runs a little torch work of its own: a proposed model's shape check on
``example_input`` (one sample), a strategy's controller. Tensors that small gain nothing from
torch's intra-op thread pool, and while worker processes keep every core busy the pool's
threads wait for cores they do not get (OpenMP workers spinning): on a loaded 2-core machine a
MnasNet's shape check took about a second with 2 threads and 0.01-0.04 s with one
(benchmarks/README.md, "Packing models onto devices"), and an RL controller's ``tell`` 7x
longer. :func:`one_thread` runs a block on one thread and restores the setting;
:func:`worker_threads` sizes a new worker's thread pool to the cores other processes leave
free (:func:`idle_cores`).

Example::

    with one_thread():
        space.check_shapes(model)      # torch.get_num_threads() == 1 here
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

__all__ = ["idle_cores", "one_thread", "worker_threads"]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with one torch intra-op thread, then restore the previous count (also
    when the block raises). The setting is process-wide: use it in the driver, not around
    a worker's training."""
    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)


def idle_cores(cores: int) -> int:
    """``cores`` less those other processes keep busy (the 1-minute load average), at least 1.

    A worker's intra-op threads only help when they get cores at the same time: on a 2-core
    machine at load 9, a one-shot worker with 2 threads took 2-18 s a training step of the
    oneshot row's small model, 0.4 s with one (each op waits for both threads to be scheduled).

    Example:
        >>> 1 <= idle_cores(4) <= 4
        True
    """
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # no load average on this platform: assume idle
        return max(1, cores)
    return max(1, min(cores, round(cores - load)))


def worker_threads(cores: int, workers: int) -> int:
    """A local worker's default torch threads: ``cores // workers``, at most the
    :func:`idle_cores`, at least 1, so the workers together use the machine without
    oversubscribing it (an idle machine: every core, shared among the workers).

    Example:
        >>> 1 <= worker_threads(8, 2) <= 4
        True
    """
    return max(1, min(cores // max(workers, 1), idle_cores(cores)))
