"""The store's checkpoint rows (a mixin of :class:`~.store.Store`, which owns the connection):
each trial's checkpoints as names in the run's checkpoint folder, recorded, read back as files,
and forgotten when their files are deleted or gone. Which checkpoints to keep is the
scheduler's decision (``Scheduler.deletable_checkpoints``); the experiment deletes a file first
and its row second, and a resume drops the rows whose files are gone
(:meth:`CheckpointRows.forget_missing_checkpoints`)."""
from __future__ import annotations

import logging
import os
import time as _time

from .checkpoint import CheckpointDir, CheckpointPathError, legacy_name
from .schema import StoreError

__all__ = ["CheckpointRows"]

_log = logging.getLogger("retiarii.engine")


class CheckpointRows:
    """Checkpoint rows of :class:`~.store.Store` (its ``path``, ``db``, ``flush`` and
    ``experiment_id``)."""

    @property
    def checkpoint_dir(self) -> str:
        """The run's checkpoint folder: the file's path without ``.db``, plus ``.checkpoints``."""
        return os.path.splitext(os.path.abspath(self.path))[0] + ".checkpoints"

    def checkpoint_file(self, name: str) -> str:
        """The file a checkpoint name (the ``path`` column) stands for, inside
        :attr:`checkpoint_dir`; raises :class:`~.checkpoint.CheckpointPathError` for a name that
        reaches outside it (an absolute path of an older store is read as :meth:`records` does)."""
        return CheckpointDir(self.checkpoint_dir).path(legacy_name(name, self.checkpoint_dir))

    def checkpoint(self, trial_id: str, step: int, path: str, fused: bool = False) -> None:
        """Record ``trial_id``'s state after ``step`` steps in checkpoint ``path`` (a name in the run's
        folder or a file there, else StoreError); ``fused``: sets ``trials.fused`` for good."""
        now = _time.time()
        try:
            path = CheckpointDir(self.checkpoint_dir).name(os.fspath(path))
        except CheckpointPathError as err:
            raise StoreError(f"checkpoint of trial {trial_id!r} at step {step}: {err}") from None
        self.flush()
        with self.db.atomic():
            if self.db.execute("UPDATE trials SET checkpoint = ?, step = ?, updated = ?, fused = max("
                               "coalesce(fused, 0), ?) WHERE id = ?", [path, int(step), now,
                                                                        int(fused), trial_id]).rowcount == 0:
                raise StoreError(f"checkpoint of unknown trial {trial_id!r}; journal "
                                 "trial_added(trial) first")
            self.db.execute(
                "INSERT INTO checkpoints (trial_id, step, path, time) "
                "VALUES (?, ?, ?, ?) ON CONFLICT (trial_id, step) DO UPDATE SET "
                "path = excluded.path, time = excluded.time",
                [trial_id, int(step), path, now])

    # ---- checkpoints ---------------------------------------------------------------------

    def _resolved(self, rows) -> list[dict]:
        """Rows with ``name`` (as recorded) and ``path`` (its file in the checkpoint folder);
        a row naming anything outside the folder is left out, and reported."""
        out = []
        for row in rows:
            row = dict(row)
            try:
                row["name"], row["path"] = row["path"], self.checkpoint_file(row["path"])
            except CheckpointPathError as err:
                _log.error("%s: ignoring the checkpoint of trial %s at step %s: %s", self.path,
                           row["trial_id"], row["step"], err)
                continue
            out.append(row)
        return out

    def checkpoints(self, trial_id: str) -> list[dict]:
        """A trial's checkpoint rows, by step: ``path`` is the file (inside the run's
        checkpoint folder), ``name`` the recorded name; rows that would reach outside the
        folder are left out (and logged)."""
        self.flush()
        return self._resolved(self.db["checkpoints"].rows_where("trial_id = ?", [trial_id],
                                                                order_by="step"))

    def last_checkpoint(self, trial_id: str) -> dict | None:
        """The trial's latest checkpoint row (``step``, ``path``, ``name``), or None."""
        rows = self.checkpoints(trial_id)
        return rows[-1] if rows else None

    def forget_missing_checkpoints(self) -> list[tuple[str, int]]:
        """Drop the current experiment's checkpoint rows whose files are gone; returns them as
        (trial, step). The driver deletes a checkpoint it no longer needs file first, row
        second (``Proposals.collect_garbage``: a crash between them must not leave a file no
        row names, which nothing would ever delete), so a driver killed between the two leaves
        a row naming nothing: a resume drops it before anything reads it."""
        self.flush()
        rows = self._resolved(self.db.query(
            "SELECT c.trial_id, c.step, c.path FROM checkpoints c JOIN trials t "
            "ON t.id = c.trial_id WHERE t.experiment_id = ? ORDER BY c.trial_id, c.step",
            [self.experiment_id]))
        gone = [(r["trial_id"], int(r["step"])) for r in rows if not os.path.exists(r["path"])]
        for trial_id, step in gone:
            self.forget_checkpoint(trial_id, step)
        return gone

    def forget_checkpoint(self, trial_id: str, step: int) -> None:
        """Drop a checkpoint row (its file was deleted, or cannot be read); the trial's
        ``checkpoint`` and ``step`` columns fall back to its newest remaining one."""
        self.flush()
        with self.db.atomic():
            self.db.execute("DELETE FROM checkpoints WHERE trial_id = ? AND step = ?",
                            [trial_id, int(step)])
            latest = self.db.execute("SELECT step, path FROM checkpoints WHERE trial_id = ? "
                                     "ORDER BY step DESC LIMIT 1", [trial_id]).fetchone()
            self.db.execute("UPDATE trials SET step = ?, checkpoint = ? WHERE id = ?",
                            [*(latest or (0, None)), trial_id])
