"""Checkpoints by value on Ray: a job's checkpoint bytes carried through the object store.

With ``RayExecutor(shared_storage=False)`` (nodes that do not share the run directory) the
driver reads each task's ``checkpoint_in`` and sends its bytes with the job
(:func:`read_inputs`); the worker actor writes them into a private folder and points the
job's tasks there (:func:`localize`), trains, and, when a task's segment ends, sends the new
checkpoint's bytes back with its ``TrialCheckpointed`` event; the driver writes them
atomically at ``checkpoint_out`` in its own run directory (:func:`write_atomically`) before
it reports the event. So every checkpoint the store names is on the driver's disk before the
runner hears of it, and resume works as it does locally.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..jobs.job import Job

__all__ = ["localize", "read_inputs", "write_atomically"]


def read_inputs(job: Job) -> dict[str, bytes | None]:
    """trial id -> the bytes of its task's ``checkpoint_in`` (None: no such file)."""
    blobs: dict[str, bytes | None] = {}
    for task in job.tasks:
        if task.checkpoint_in is not None:
            try:
                with open(task.checkpoint_in, "rb") as f:
                    blobs[task.trial_id] = f.read()
            except FileNotFoundError:
                blobs[task.trial_id] = None  # the worker reports the missing file
    return blobs


def localize(job: Job, blobs: dict[str, bytes | None], workdir: str,
             outputs: dict[str, str]) -> Job:
    """``job`` with its checkpoints moved into ``workdir``: the bytes the driver sent are
    written there, and each ``checkpoint_out`` becomes a local file (remembered in
    ``outputs``) whose bytes go back to the driver."""
    tasks = []
    for i, task in enumerate(job.tasks):
        change: dict[str, Any] = {}
        data = blobs.get(task.trial_id)
        if task.checkpoint_in is not None and data is not None:
            change["checkpoint_in"] = os.path.join(workdir, f"in-{i}.pt")
            with open(change["checkpoint_in"], "wb") as f:
                f.write(data)
        # A checkpoint_in the driver had no file for stays as it is: loading it fails
        # with the driver's path in the message, which is the one the user can check.
        if task.checkpoint_out is not None:
            change["checkpoint_out"] = os.path.join(workdir, f"out-{i}.pt")
            outputs[change["checkpoint_out"]] = task.checkpoint_out
        tasks.append(dataclasses.replace(task, **change))
    return dataclasses.replace(job, tasks=tasks)


def write_atomically(path: str, data: bytes) -> None:
    """As :func:`retiarii.engine.storage.checkpoint.save` writes: a temporary file, then rename."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
