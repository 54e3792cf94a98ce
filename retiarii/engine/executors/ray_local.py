"""Ray on this machine and a job's environment: a private local instance bound to 127.0.0.1
(:func:`start_local_ray`), and which parts of a runtime environment the job uploads at
``ray.init`` and which each actor is given (:func:`split_runtime_env`).
"""
from __future__ import annotations

import shutil
import tempfile

import ray

__all__ = ["split_runtime_env", "start_local_ray"]


def start_local_ray(num_cpus: float, num_gpus: float | None = None) -> str:
    """Start a private Ray instance on this machine that listens on 127.0.0.1 only.

    No dashboard, and a temporary directory of its own (sockets, logs, the object store's
    spill files), which the caller removes after ``ray.shutdown()``.

    Example::

        temp_dir = start_local_ray(num_cpus=4)
        ...
        ray.shutdown(); shutil.rmtree(temp_dir, ignore_errors=True)

    Args:
        num_cpus: logical CPUs the instance offers (Ray schedules by these, not by cores).
        num_gpus: GPUs it offers; None lets Ray count the visible ones.

    Returns:
        The instance's temporary directory.
    """
    temp_dir = tempfile.mkdtemp(prefix="retiarii-ray-")
    try:
        # address="local": a new instance even when RAY_ADDRESS names a cluster.
        # _node_ip_address: every server (GCS, raylet, object manager, workers) binds to it.
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                 num_cpus=num_cpus, num_gpus=num_gpus, _temp_dir=temp_dir)
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return temp_dir


def split_runtime_env(env: dict | None) -> tuple[dict, dict]:
    """(the job's, the actors') parts of a Ray runtime environment: a ``working_dir`` (with its
    ``excludes``) or ``py_modules`` naming local paths are uploaded by ``ray.init``, the job's;
    the rest (pip, env_vars, URIs) is given to each actor."""
    job: dict = {}
    actor: dict = {}
    for key, value in (env or {}).items():
        local = key == "working_dir" and isinstance(value, str) and "://" not in value
        if key == "py_modules":
            local = any(isinstance(m, str) and "://" not in m for m in value)
        (job if local or key == "excludes" else actor)[key] = value
    if "excludes" in job and "working_dir" not in job and "py_modules" not in job:
        actor["excludes"] = job.pop("excludes")
    return job, actor
