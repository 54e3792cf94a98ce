"""``retiarii run/resume --tensorboard DIR``: every trial's metrics also written as TensorBoard
event files (torch's ``SummaryWriter``), one run folder per trial (``DIR/e1-trial-0007``).

The metrics are read back from the store (a read-only connection) each time a trial finishes,
so nothing changes in the engine or its workers; ``DIR/retiarii-written.json`` remembers the
last metric row written, so a resumed search appends the new results only.

Example::

    log = TensorBoardLog("runs/demo.db", "runs/tb")
    log.sync()            # writes what the store holds that DIR lacks
    log.close()
"""
from __future__ import annotations

import json
import os
import sqlite3
import urllib.parse
from typing import Callable

__all__ = ["TensorBoardLog", "add_tensorboard_flag", "with_tensorboard"]

MARK = "retiarii-written.json"


def add_tensorboard_flag(parser) -> None:
    parser.add_argument("--tensorboard", default=None, metavar="DIR",
                        help="also write every trial's metrics as TensorBoard event files in DIR "
                             "(one run per trial; `tensorboard --logdir DIR`); needs the "
                             "dashboard extra (pip install retiarii[dashboard])")


class TensorBoardLog:
    """Writes the store's metric rows to TensorBoard, one ``SummaryWriter`` per trial."""

    def __init__(self, store: str, folder: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(f"--tensorboard needs the tensorboard package ({err}): pip "
                              f"install retiarii[dashboard]") from None
        self._writer_class = SummaryWriter
        self.store, self.folder = os.path.abspath(store), folder
        os.makedirs(folder, exist_ok=True)
        self._writers: dict = {}
        self.last = self._read_mark()

    def _read_mark(self) -> int:
        try:
            with open(os.path.join(self.folder, MARK)) as f:
                mark = json.load(f)
        except (OSError, ValueError):
            return 0
        # another store's mark (DIR reused): start over for this one
        return int(mark.get("rowid", 0)) if mark.get("store") == self.store else 0

    def sync(self) -> int:
        """Write the metric rows added since the last sync; returns how many."""
        if not os.path.exists(self.store):
            return 0
        uri = "file:" + urllib.parse.quote(self.store) + "?mode=ro"
        db = sqlite3.connect(uri, uri=True, timeout=10)
        try:
            rows = db.execute("SELECT rowid, trial_id, step, name, value FROM metrics WHERE "
                              "rowid > ? ORDER BY rowid", [self.last]).fetchall()
        finally:
            db.close()
        for rowid, trial_id, step, name, value in rows:
            if value is not None:  # NaN is stored as NULL: nothing to draw
                self._writer(trial_id).add_scalar(name, value, step)
            self.last = max(self.last, rowid)
        for w in self._writers.values():
            w.flush()
        with open(os.path.join(self.folder, MARK), "w") as f:
            json.dump({"store": self.store, "rowid": self.last}, f)
        return len(rows)

    def _writer(self, trial_id: str):
        if trial_id not in self._writers:
            self._writers[trial_id] = self._writer_class(os.path.join(self.folder, trial_id))
        return self._writers[trial_id]

    def close(self) -> None:
        self.sync()
        for w in self._writers.values():
            w.close()
        self._writers.clear()


def with_tensorboard(progress: Callable[[dict], None], flags: dict) -> Callable[[dict], None]:
    """``progress`` (the CLI's display, called after each finished trial, the last included),
    also syncing the TensorBoard folder of ``flags["tensorboard"]`` (the CLI's flags) when
    given; refused with a :class:`~retiarii.cli_common.CliError` without tensorboard."""
    from .cli_common import CliError

    folder = flags.get("tensorboard")
    if not folder:
        return progress
    try:
        log = TensorBoardLog(flags["store"], folder)
    except ImportError as err:
        raise CliError(str(err)) from None

    def call(summary: dict) -> None:
        progress(summary)
        log.sync()

    return call
