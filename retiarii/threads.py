"""Small torch work in a process that shares its cores with busy workers, on one thread.

The driver of a search runs a little torch work of its own: a proposed model's shape check on
``example_input`` (one sample), a strategy's controller. Tensors that small gain nothing from
torch's intra-op thread pool, and while worker processes keep every core busy the pool's
threads wait for cores they do not get (OpenMP workers spinning): on a loaded 2-core machine a
MnasNet's shape check took about a second with 2 threads and 0.01-0.04 s with one
(benchmarks/README.md, "Packing models onto devices"), and an RL controller's ``tell`` 7x
longer. :func:`one_thread` runs a block on one thread and restores the setting;
:func:`worker_threads` is a new local worker's share of the cores.

Example::

    with one_thread():
        space.check_shapes(model)      # torch.get_num_threads() == 1 here
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["one_thread", "worker_threads"]


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


def worker_threads(cores: int, workers: int) -> int:
    """A local worker's default torch threads: ``cores // workers``, at least 1, so the
    workers together use the machine's cores without oversubscribing them.

    It never depends on the machine's load: the thread count decides how CPU kernels split
    their reductions, so a count read from the load average would make two runs of one
    seeded search round differently (the reproducibility contract, docs/optimization.md).
    On a machine other processes keep busy, give ``threads_per_worker=1`` (a worker's
    threads wait for cores they do not get: a one-shot step of the oneshot row took 2-18 s
    with 2 threads at load 9 on 2 cores, 0.4 s with one).

    Example:
        >>> worker_threads(8, 2)
        4
    """
    return max(1, cores // max(workers, 1))
