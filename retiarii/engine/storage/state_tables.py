"""Saved algorithm states, whose append-only lists are stored one row per item.

A strategy's or scheduler's ``state_dict()`` is saved after every model (every decision), and
grows with the search. The lists a state names under its ``append_only`` key only ever grow at
their end, so :class:`StateTables` keeps them in ``state_items``, a row per item, and a save
writes only the items added since the last one; the rest of the state is one JSON row of
``strategy_state`` / ``scheduler_state``, where each such list stands as ``{"append_only_items":
n}``. A dict in the state with its own ``append_only`` (the scheduler's state inside the
runner's) is handled the same way, its lists named by path (``"scheduler/log"``).

:class:`~.store.Store` owns one; ``docs/store.md`` (``state_items``) shows the tables.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the driver imports it with the store
    import sqlite_utils

import json
import time as _time


from .schema import StoreError

__all__ = ["StateTables"]


def _split_append_only(state: dict, table: str, path: str = "") -> tuple[dict, dict[str, list]]:
    """``state`` with each list its ``append_only`` names replaced by ``{"append_only_items":
    n}``, and those lists by path (``"log"``, ``"scheduler/log"``): see StateTables.save."""
    names = state.get("append_only") or []
    head, lists = state, {}
    for key, value in state.items():
        if isinstance(value, dict) and "append_only" in value:
            sub_head, sub_lists = _split_append_only(value, table, f"{path}{key}/")
            head = dict(head) if head is state else head
            head[key] = sub_head
            lists.update(sub_lists)
    for name in names:
        if not isinstance(state.get(name), list):
            raise StoreError(f"{table}: state['append_only'] names {path + name!r}, which is "
                             f"not a list in the state")
        head = dict(head) if head is state else head
        head[name] = {"append_only_items": len(state[name])}
        lists[f"{path}{name}"] = state[name]
    return head, lists


def _join_append_only(head: dict, items, path: str = "") -> dict:
    """The inverse of :func:`_split_append_only`; ``items(path, n)`` reads a list back."""
    for key, value in head.items():
        if isinstance(value, dict) and "append_only" in value:
            head[key] = _join_append_only(value, items, f"{path}{key}/")
    for name in head.get("append_only") or []:
        head[name] = items(f"{path}{name}", head[name]["append_only_items"])
    return head


class StateTables:
    """The saved states of one store file: ``save`` the latest, ``load`` it back.

    Example::

        states = StateTables(db, "runs/exp.db")
        states.save("strategy_state", 1, {"log": [1, 2], "append_only": ["log"]})
        states.save("strategy_state", 1, {"log": [1, 2, 3], "append_only": ["log"]})  # one row
        states.load("strategy_state", 1)   # {"log": [1, 2, 3], "append_only": ["log"]}

    Args:
        db: the store's open database (its schema has the state tables).
        path: the file's path, for error messages.
    """

    def __init__(self, db: sqlite_utils.Database, path: str):
        self.db, self.path = db, path
        self._saved: dict[tuple[str, int], str] = {}  # last state JSON written, per table
        # (table, experiment, list name) -> (items saved, JSON of the last one)
        self._saved_items: dict[tuple[str, int, str], tuple[int, str | None]] = {}

    def save(self, table: str, experiment: int, state: dict) -> None:
        """Write ``state`` as the latest of ``table`` for ``experiment``.

        The lists that ``state["append_only"]`` names (and, in the same way, those of any value
        of the state that is a dict with its own ``append_only``, e.g. the scheduler's state in
        the runner's) go to ``state_items``, a row per item, and only the items added since the
        last save are written (a list that changed elsewhere than at its end is rewritten
        whole); the rest of the state is one JSON row.
        """
        head, lists = _split_append_only(state, table)
        text = json.dumps(head)
        key = (table, experiment)
        if self._saved.get(key) == text:
            return  # the runner saves after every decision; most change nothing
        saved = {}
        with self.db.atomic():
            for path, items in lists.items():
                saved[(table, experiment, path)] = self._save_items(table, experiment, path, items)
            # Plain SQL: this is on the engine's hot path.
            self.db.execute(f"INSERT OR REPLACE INTO [{table}] (experiment_id, state, time) "
                            "VALUES (?, ?, ?)", [experiment, text, _time.time()])
        self._saved_items.update(saved)  # once committed
        self._saved[key] = text

    def _save_items(self, table: str, experiment: int, name: str,
                    items: list) -> tuple[int, str | None]:
        """Write the items of ``items`` not yet saved; (items saved, JSON of the last one)."""
        key = (table, experiment, name)
        if key not in self._saved_items:  # first save in this process: what is on disk?
            count, last = self.db.execute(
                "SELECT count(*), (SELECT item FROM state_items WHERE kind = ? AND "
                "experiment_id = ? AND name = ? ORDER BY idx DESC LIMIT 1) FROM state_items "
                "WHERE kind = ? AND experiment_id = ? AND name = ?", key + key).fetchone()
            self._saved_items[key] = (count, last)
        count, last = self._saved_items[key]
        if count > len(items) or (count and json.dumps(items[count - 1]) != last):
            # Not an extension of what was saved (a strategy restored from older state):
            # rewrite the list.
            self.db.execute("DELETE FROM state_items WHERE kind = ? AND experiment_id = ? AND "
                            "name = ?", key)
            count = 0
        new = [json.dumps(item) for item in items[count:]]
        if new:
            self.db.conn.executemany(
                "INSERT INTO state_items (kind, experiment_id, name, idx, item) "
                "VALUES (?, ?, ?, ?, ?)",
                [(table, experiment, name, count + i, item) for i, item in enumerate(new)])
            last = new[-1]
        return len(items), (last if items else None)

    def load(self, table: str, experiment: int) -> dict | None:
        """The latest state of ``table`` for ``experiment``, its lists put back, or None."""
        row = self.db.execute(f"SELECT state FROM [{table}] WHERE experiment_id = ?",
                              [experiment]).fetchone()
        if row is None:
            return None

        def items(path: str, want: int) -> list:
            found = [json.loads(item) for item, in self.db.execute(
                "SELECT item FROM state_items WHERE kind = ? AND experiment_id = ? AND name = ? "
                "AND idx < ? ORDER BY idx", [table, experiment, path, want])]
            if len(found) != want:
                raise StoreError(f"{self.path}: the saved {table} lists {want} items of "
                                 f"{path!r} but state_items holds {len(found)}; the file was "
                                 "edited or is corrupt")
            return found

        return _join_append_only(json.loads(row[0]), items)
