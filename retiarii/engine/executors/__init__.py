"""Executors: where jobs run. One interface (:mod:`.base`), several back ends."""
from ..jobs.job import (
    Event, Executor, FailureKind, Job, JobFailed, JobFinished, JobStarted, TrialCheckpointed, TrialResult,
    TrialTask,
)
from .local import LocalExecutor

from ...moved import package_getattr

__getattr__ = package_getattr(__name__)  # old submodule names as attributes (retiarii/moved.py)
