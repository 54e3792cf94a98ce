"""Why models failed, counted: the reasons ``status`` shows and a search that trained nothing.

Every failed model keeps its error in the store (``models.error``: the reason on its first
line, then the traceback), whatever failed: building it (a shape mismatch, a mutation or a
trace that cannot apply), its training (an exception, a NaN loss) or the environment (a lost
worker, out of memory). :func:`failure_summary` counts them by reason; a search whose every
model failed ends with :class:`SearchFailed` (``retiarii run`` exits with status 1) instead of
an empty table.
"""
from __future__ import annotations

import collections
import traceback

from .experiment_support import ExperimentError

__all__ = ["SearchFailed", "all_failed_message", "build_error", "failure_summary", "reason_of",
           "with_failures"]


class SearchFailed(ExperimentError):
    """Every model of the search failed: nothing was trained.

    The store keeps every model's error (``retiarii status DB --errors``). Attributes:
    ``summary`` (what :meth:`Experiment.run` would have returned), ``failures`` (the
    :func:`failure_summary`).
    """

    def __init__(self, message: str, summary: dict, failures: dict):
        super().__init__(message)
        self.summary, self.failures = summary, failures


def reason_of(error: str | None) -> str:
    """The line of an error that says what happened: a traceback's last line, else the
    first; the engine's own prefixes (``model error: ``) dropped."""
    lines = (error or "").strip().splitlines()
    if not lines:
        return "(no reason recorded)"
    line = lines[-1] if lines[0].startswith("Traceback") else lines[0]
    for prefix in ("model error: ", "environment error: "):
        if line.startswith(prefix):
            line = line[len(prefix):]
    return line.strip()


def build_error(err: BaseException) -> str:
    """The error of a model that could not be built: its reason, then the traceback."""
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    return f"cannot be built: {type(err).__name__}: {err}\n{tb}"


def failure_summary(models: list[dict]) -> dict:
    """``{"failed": n, "models": m, "trained": t, "reasons": [[reason, count], ...]}`` of
    ``models`` (store rows), the most common reason first."""
    failed = [m for m in models if m["status"] == "failed"]
    counts = collections.Counter(reason_of(m.get("error")) for m in failed)
    return {"failed": len(failed), "models": len(models),
            "trained": sum(m["status"] == "trained" for m in models),
            "reasons": [[r, n] for r, n in counts.most_common()]}


def all_failed_message(path: str, failures: dict) -> str | None:
    """What :class:`SearchFailed` says when every model failed, else None."""
    if failures["failed"] == 0 or failures["failed"] < failures["models"]:
        return None  # something trained, or is still to train (a resumable stop)
    reason, n = failures["reasons"][0]
    return (f"{path}: all {failures['failed']} models failed, nothing was trained; most common "
            f"reason ({n} of {failures['failed']}): {reason}. Every model's error: retiarii "
            f"status {path} --errors")


def with_failures(store, path: str, summary: dict) -> dict:
    """``summary`` with why models failed (``summary["failures"]``); a search whose every
    model failed raises :class:`SearchFailed` instead (the experiment's status "failed")."""
    summary["failures"] = failures = failure_summary(store.models())
    message = all_failed_message(path, failures)
    if message is None:
        return summary
    store.set_experiment_status("failed")
    raise SearchFailed(message, summary, failures)
