"""A new trial's fused mark (``trials.fused``), inherited from the trial whose checkpoint it starts from.

Weights trained fused round unlike weights trained alone, and they keep that rounding when
another trial starts from them: a PBT clone starts from its donor's checkpoint (the trial's
``donor``, a checkpoint of its ``parent``), a strategy's child with ``inherit_weights`` from
its parent model's latest checkpoint (``spec["inherit"]``). The store marks such a trial fused
in the transaction that adds it when the trial it starts from is marked (``trials.fused``) or
a ``plans`` row lists that trial in a fused unit (stores older than schema 11 know only
that). The mark is per trial, not per checkpoint: a clone of a donor that trained fused only
after the step it was cloned at is marked too (it may round unlike alone: compare it within
the fused tolerance), never the other way round.

Example::

    sources = checkpoint_sources(db, record, spec)     # ["pbt-0003"]
    inherit_fused(db, "pbt-0007", sources)             # trials.fused = 1 when pbt-0003 is
"""
from __future__ import annotations

from typing import Any

__all__ = ["checkpoint_sources", "inherit_fused"]


def checkpoint_sources(db: Any, record: dict, spec: Any) -> list[str]:
    """The trials whose checkpoint a trial (its journal ``record`` and ``spec``) starts from:
    the parent of a PBT clone with a donor checkpoint, and the writer of each checkpoint
    named as its ``donor`` or ``spec["inherit"]`` (a strategy's inherited weights)."""
    sources = [record["parent"]] if record.get("donor") and record.get("parent") else []
    names = [name for name in (record.get("donor"),
                               spec.get("inherit") if isinstance(spec, dict) else None)
             if isinstance(name, str) and name]
    if names:
        marks = ", ".join("?" * len(names))
        sources += [row[0] for row in db.execute(
            f"SELECT DISTINCT trial_id FROM checkpoints WHERE path IN ({marks})", names)]
    return sorted(set(sources))


def inherit_fused(db: Any, trial_id: str, sources: list[str]) -> bool:
    """Mark ``trial_id`` fused when one of ``sources`` trained fused (its ``trials.fused``, or
    a fused unit of a ``plans`` row); run it in the transaction that adds the trial. Returns
    whether it marked it."""
    if not sources:
        return False
    marks = ", ".join("?" * len(sources))
    fused = db.execute(
        f"SELECT 1 FROM trials WHERE fused = 1 AND id IN ({marks}) UNION ALL "
        "SELECT 1 FROM plans, json_each(plans.units) AS unit, "
        "json_each(unit.value, '$.trials') AS member "
        f"WHERE json_extract(unit.value, '$.fused') AND member.value IN ({marks}) LIMIT 1",
        [*sources, *sources]).fetchone()
    if fused is not None:
        db.execute("UPDATE trials SET fused = 1 WHERE id = ?", [trial_id])
    return fused is not None
