"""The runner's journal read back from the store's rows: trials added, transitions, results and
checkpoints, in the order the runner wrote them (what :meth:`.store.Store.records` returns for
:meth:`~retiarii.engine.runner.trial_runner.TrialRunner.resume`).

The payloads are those of :class:`~retiarii.engine.runner.journal.MemoryJournal`, so a runner
resumes the same from either. Checkpoint names (and a PBT child's donor) that older stores hold
as absolute paths are read back as names of the run's folder (:func:`.checkpoint.legacy_name`).

Example::

    read_records(store.db, "t.experiment_id = ?", [1], store.checkpoint_dir)
    # [("trial_added", {...}), ("transition", {...}), ("result", {...}), ("checkpoint", {...})]
"""
from __future__ import annotations

import json
import math
from typing import Any

from .checkpoint import legacy_name

__all__ = ["read_records"]


def read_records(db: Any, where: str, params: list, folder: str) -> list[tuple[str, dict]]:
    """The journal of the trials ``where`` selects (SQL on ``trials t``; ``params`` its
    values): ``trial_added`` payloads in creation order, then each trial's transitions,
    results and checkpoints in the order written. ``folder``: the run's checkpoint folder."""
    out: list[tuple[str, dict]] = []
    for spec, record in db.execute(
            f"SELECT spec, record FROM trials t WHERE {where} ORDER BY seq", params):
        payload = json.loads(record)
        payload.setdefault("config", json.loads(spec))
        out.append(("trial_added", payload))
    for trial_id, old, new, reason in db.execute(
            f"SELECT e.trial_id, e.old_state, e.new_state, e.reason FROM events e JOIN trials t "
            f"ON t.id = e.trial_id WHERE e.old_state IS NOT NULL AND {where} ORDER BY e.id",
            params):  # (the 'added' pseudo-event has no old state and no transition)
        out.append(("transition", {"trial_id": trial_id, "old": old, "new": new,
                                   "reason": reason}))
    current: dict | None = None
    for trial_id, step, name, value, time in db.execute(
            f"SELECT m.trial_id, m.step, m.name, m.value, m.time FROM metrics m JOIN trials t "
            f"ON t.id = m.trial_id WHERE {where} ORDER BY t.seq, m.step, m.rowid", params):
        if current is None or (current["trial_id"], current["step"]) != (trial_id, step):
            current = {"trial_id": trial_id, "step": step, "metrics": {}, "time": time}
            out.append(("result", current))
        current["metrics"][name] = math.nan if value is None else value
    for _, payload in out:  # a PBT child's donor: a checkpoint of another trial
        if payload.get("donor") is not None:
            payload["donor"] = legacy_name(payload["donor"], folder)
    for trial_id, step, path in db.execute(
            f"SELECT c.trial_id, c.step, c.path FROM checkpoints c JOIN trials t "
            f"ON t.id = c.trial_id WHERE {where} ORDER BY t.seq, c.rowid", params):
        out.append(("checkpoint", {"trial_id": trial_id, "step": step,
                                   "path": legacy_name(path, folder)}))
    return out
