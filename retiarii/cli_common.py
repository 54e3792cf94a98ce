"""What the ``retiarii`` commands share: the error a user can fix (:class:`CliError`), the
progress line, tables of the best models, and opening a run's store for reading."""
from __future__ import annotations

import json
import os
import sys

from .optim.passes import parse_settings

__all__ = ["CliError"]


class CliError(Exception):
    """A problem the user can fix: printed as one line (culprit and fix), exit status 2."""


# ---- building an experiment from flags (run) or from the store (resume) -------------------------


class Progress:
    """A one-line progress bar with the best value so far, redrawn after each trial."""

    def __init__(self, total: int | None):
        self.total = total
        self.tty = sys.stderr.isatty()

    def __call__(self, summary: dict) -> None:
        if "one_shot" in summary:
            from .cli_one_shot import progress_line

            print(progress_line(summary), file=sys.stderr, flush=True)
            return
        done = sum(v for k, v in summary["trials"].items() if k in ("TERMINATED", "ERRORED"))
        total = self.total or max(done, 1)
        width = 30
        filled = min(width, int(width * done / total))
        # summary["best"] ranks finished trials only: the best never goes down
        best = f"{summary['best'][0]['value']:.4f}" if summary["best"] else "-"
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} trials done, "
                f"{running_text(summary)}, best {best}")
        print(("\r" if self.tty else "") + line, end="" if self.tty else "\n",
              file=sys.stderr, flush=True)


def running_text(summary: dict) -> str:
    """What trains now, in the words of the workers' view: ``2 jobs, 11 models training``
    (a grouped job trains several models on one worker), or ``3 models training`` when each
    job is one model."""
    models = summary.get("running", 0)
    jobs = summary.get("jobs", models)
    noun = "model" if models == 1 else "models"
    if jobs == models:
        return f"{models} {noun} training"
    return f"{jobs} job{'' if jobs == 1 else 's'}, {models} {noun} training"


def format_table(rows: list[list], headers: list[str]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def best_table(best: list[dict]) -> str:
    rows = [[i + 1, b["model_id"], b["trial_id"], f"{b['value']:.4f}", b["step"],
             json.dumps(b["sample"])[:90]] for i, b in enumerate(best)]
    return format_table(rows, ["rank", "model", "trial", "value", "epoch", "sample"])


def positive_flag(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise CliError(f"{flag} must be 1 or more, got {value}")


def print_best(summary: dict) -> None:
    if "one_shot" in summary:
        from .cli_one_shot import print_result

        print_result(summary, format_table)
    else:
        print(best_table(summary["best"]))


def open_store(db: str, experiment: int | None = None):
    """The store ``db`` (which must exist: nothing is created), on experiment ``experiment``
    (``--experiment N``; default: its latest)."""
    from .engine.storage.store import Store

    if not os.path.exists(db):
        raise CliError(f"{db} does not exist: give the SQLite file of a run (retiarii run "
                       f"... --store FILE)")
    if not os.path.isfile(db):
        raise CliError(f"{db} is not a file: give the SQLite file of a run")
    if not os.access(db, os.R_OK):
        raise CliError(f"{db}: permission denied: make it readable "
                       f"(e.g. chmod u+r {db})")
    store = Store(db)
    experiments = store.experiments()
    if not experiments:
        store.close()
        raise CliError(f"{db} holds no experiment: start one with `retiarii run`")
    ids = [e["id"] for e in experiments]
    if experiment is not None and experiment not in ids:
        store.close()
        raise CliError(f"--experiment {experiment}: {db} holds experiments "
                       f"{', '.join(map(str, ids))} (retiarii status {db} lists them)")
    store.use_experiment(ids[-1] if experiment is None else experiment)
    return store


def store_metric(store) -> tuple[str, str]:
    config = store.get_experiment()["config"]
    return config.get("metric", "val_acc"), config.get("mode", "max")


def passes_flag(text: str | None) -> dict | None:
    """``--passes batching=auto,mine=on`` -> the Experiment's ``passes`` (refused naming the
    registered passes when a name or setting is unknown)."""
    if not text:
        return None
    try:
        return parse_settings(text)
    except Exception as err:  # noqa: BLE001 (PlanError or ValueError: the message says why)
        raise CliError(f"--passes {text!r}: {err}") from None


def print_failures(summary: dict, db: str) -> None:
    """Models that failed in a search that trained others (one where all failed raised
    SearchFailed): how many, and the most common reason."""
    failures = summary.get("failures") or {}
    if failures.get("failed"):
        reason, n = failures["reasons"][0]
        print(f"\n{failures['failed']} of {failures['models']} models failed; most common "
              f"reason ({n}): {reason}  (retiarii status {db} --errors)", file=sys.stderr)
