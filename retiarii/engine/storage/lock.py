"""One driver per store: an exclusive lock held for the driver's whole life.

Two drivers writing one store would both train the same trials (and one would then die on a
duplicate id). A driver (``Experiment.run``/``resume``) therefore takes an exclusive
``flock`` on ``<store>.lock`` before it writes anything and keeps it until it ends; a second
driver is refused at once with an error naming the holder (pid, host, since when).

Why ``flock`` on a file of its own: the kernel drops the lock when the process dies, however it
dies (SIGKILL included), so the lock of a dead driver is never stale: the next driver simply
takes it, and the holder's details in the file are rewritten. SQLite's own locks on the
database file are POSIX record locks, held per transaction, and independent of this one.

Example::

    with StoreLock("runs/exp.db"):
        ...                                  # this process alone drives runs/exp.db

Copying a run directory copies the lock file but not the lock: the copy can be resumed while
the original runs. On network file systems ``flock`` may not lock across machines: run one
driver per store there by other means.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import time


class StoreLocked(RuntimeError):
    """Another live driver holds the store."""


class StoreLock:
    """An exclusive lock on ``<store>.lock``, held from :meth:`acquire` to :meth:`release`.

    Args:
        store: the store's path; the lock file sits next to it.
    """

    def __init__(self, store: str | os.PathLike):
        self.store = os.fspath(store)
        self.path = self.store + ".lock"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "StoreLock":
        """Take the lock, or raise :class:`StoreLocked` naming the driver that has it."""
        if self._fd is not None:
            return self
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise StoreLocked(
                f"cannot create the lock file {self.path} ({err.strerror}): a driver needs to "
                f"write the store's folder; make it writable, or copy the run elsewhere") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise StoreLocked(
                f"{self.store} is in use by another driver ({holder}); only one driver may run "
                f"an experiment's store at a time: wait for it to end or stop it (Ctrl-C), "
                f"then resume") from None
        except OSError as err:
            os.close(fd)
            raise StoreLocked(f"cannot lock {self.path} ({err.strerror})") from None
        # The lock is ours: whatever the file said belonged to a driver that has died.
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the lock up (idempotent). The file stays: removing it would race a driver
        that has just opened it."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> "StoreLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    """'pid P on host H since T' from the lock file, as far as it can be read."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        since = datetime.datetime.fromtimestamp(info["since"]).isoformat(timespec="seconds")
        return f"pid {info['pid']} on host {info['host']} since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a driver that is still starting"
