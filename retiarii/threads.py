"""Small torch work in a process that shares its cores with busy workers, on one thread.

The driver of a search runs a little torch work of its own: a proposed model's shape check on
``example_input`` (one sample), a strategy's controller. Tensors that small gain nothing from
torch's intra-op thread pool, and while worker processes keep every core busy the pool's
threads wait for cores they do not get (OpenMP workers spinning): on a loaded 2-core machine a
MnasNet's shape check took about a second with 2 threads and 0.01-0.04 s with one
(benchmarks/README.md, "Packing models onto devices"), and an RL controller's ``tell`` 7x
longer. :func:`one_thread` runs a block on one thread and restores the setting.

Example::

    with one_thread():
        space.check_shapes(model)      # torch.get_num_threads() == 1 here
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["one_thread"]


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
