"""A machine-wide lock that pauses the local workers' training while a cost is measured.

A latency timed while other processes train on the same cores (or GPU) measures the load,
not the model. Two lock files in the machine's temp folder (``fcntl.flock``; one pair per
user) make a readers-writer lock with the measurer first:

* a worker runs each training batch under :meth:`MeasureLock.training`: it passes the
  *gate* (a shared lock taken and dropped, so it waits while a measurement holds the gate)
  and holds the *busy* lock shared for the batch;
* the measurer, :meth:`MeasureLock.measuring`, closes the gate (exclusive: no new batch
  starts), then takes *busy* exclusively (it waits for the batches in flight to end), times,
  and opens both.

So a measurement waits at most one batch of each worker and never for a stream of new
batches (the gate keeps new ones out), and no batch runs while it times. A batch that itself
waits for a worker the gate keeps out (the ranks of one job) would make that wait endless:
the measurer polls, re-opens the gate for a moment after :data:`PATIENCE` seconds (doubling),
and after :data:`LIMIT` seconds measures anyway (:attr:`MeasureLock.contended`). flock locks belong
to an open file, so two ``MeasureLock`` objects in one process exclude each other as two
processes do (the tests use that). Workers on other machines are not paused: they do not
share this machine's cores.

Example:
    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> measurer, worker = MeasureLock(folder), MeasureLock(folder)
    >>> with measurer.measuring():
    ...     worker.try_training()          # a new batch would wait
    False
    >>> worker.try_training()
    True
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from typing import Iterable, Iterator

__all__ = ["LIMIT", "PATIENCE", "MeasureLock", "machine_lock", "paced"]

PATIENCE = 2.0  # seconds a measurement first waits for the batches in flight
LIMIT = 120.0   # seconds after which it measures beside a batch that never ends
_REOPEN_S = 0.05  # how long the gate stays open between two rounds
_POLL_S = 0.005


def _poll(fd: int, seconds: float) -> bool:
    """Take ``fd`` exclusively within ``seconds`` (polling: a blocked flock has no timeout)."""
    deadline = time.perf_counter() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.perf_counter() >= deadline:
                return False
            time.sleep(_POLL_S)


class MeasureLock:
    """The gate and busy lock files in ``folder`` (default: the machine's temp folder, one
    pair per user). ``seconds`` sums the time spent inside :meth:`measuring` (waiting for
    the batches in flight included): the share of a search during which workers pause."""

    def __init__(self, folder: str | None = None):
        folder = folder or tempfile.gettempdir()
        uid = os.getuid() if hasattr(os, "getuid") else 0
        self.paths = tuple(os.path.join(folder, f"retiarii-measure-{uid}.{name}")
                           for name in ("gate", "busy"))
        self._fds: tuple[int, int] | None = None
        self.seconds = 0.0
        self.contended = 0  # measurements that gave up waiting for a batch in flight

    def _open(self) -> tuple[int, int]:
        if self._fds is None:  # opened once: a batch costs two flock calls, no open
            self._fds = tuple(os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in self.paths)
        return self._fds

    @contextlib.contextmanager
    def measuring(self, patience: float = PATIENCE, limit: float = LIMIT) -> Iterator[None]:
        """Hold every local worker between batches for the block.

        A batch in flight may itself wait for a worker held at the gate: the ranks of one
        job exchange gradients inside a batch, so a rank that entered its batch waits for a
        rank the closed gate keeps out, and waiting for the first one's batch to end would
        hang both searches (and this one). So the busy lock is polled, not waited on: after
        ``patience`` seconds without it the gate opens for a moment (those batches meet and
        end) and the measurement queues again, waiting twice as long each round. After
        ``limit`` seconds in all it measures beside whatever batch is still in flight, holding
        only the gate, and counts it in :attr:`contended`: a figure that may include load,
        better than a search that never ends.
        """
        gate, busy = self._open()
        start = time.perf_counter()
        held = False
        try:
            while True:
                fcntl.flock(gate, fcntl.LOCK_EX)  # no batch starts from now on
                held = _poll(busy, min(patience, max(0.0, start + limit - time.perf_counter())))
                if held or time.perf_counter() - start >= limit:
                    break
                fcntl.flock(gate, fcntl.LOCK_UN)  # let the ranks kept out meet theirs
                time.sleep(_REOPEN_S)
                patience *= 2
            if not held:
                self.contended += 1
            try:
                yield
            finally:
                if held:
                    fcntl.flock(busy, fcntl.LOCK_UN)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
            self.seconds += time.perf_counter() - start

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """One training batch: waits while a measurement runs, and delays the next one."""
        gate, busy = self._open()
        fcntl.flock(gate, fcntl.LOCK_SH)  # waits while the gate is closed
        try:
            fcntl.flock(busy, fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(busy, fcntl.LOCK_UN)

    def try_training(self) -> bool:
        """Whether a batch could start now (without waiting; nothing is held after)."""
        gate, _ = self._open()
        try:
            fcntl.flock(gate, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(gate, fcntl.LOCK_UN)
        return True

    def try_measuring(self) -> bool:
        """Whether a measurement could start now: no batch in flight (nothing held after)."""
        _, busy = self._open()
        try:
            fcntl.flock(busy, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(busy, fcntl.LOCK_UN)
        return True

    def close(self) -> None:
        if self._fds is not None:
            for fd in self._fds:
                os.close(fd)
            self._fds = None


_MACHINE: MeasureLock | None = None


def machine_lock() -> MeasureLock:
    """This process's handle on the machine's lock (opened on first use)."""
    global _MACHINE
    if _MACHINE is None:
        _MACHINE = MeasureLock()
    return _MACHINE


def paced(batches: Iterable, lock: MeasureLock | None = None) -> Iterator:
    """``batches``, each one's training held under ``lock.training()`` (default: the
    machine's): the lock is taken before a batch is handed out and dropped when the next is
    asked for (or the loop ends), so a measurement never overlaps a batch."""
    lock = lock or machine_lock()
    for batch in batches:
        with lock.training():
            yield batch
