"""The base models' graphs of an experiment, kept in the store (``base_graphs``) so that what
the mutators changed in a model can be shown against the base it was built from (the
dashboard's model page), without importing or tracing the space's code again."""
from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["start", "record_bases", "base_graph"]


def start(store: Any, config: dict, seed: int | None, path: str, space: Any) -> int:
    """Record a new experiment (named after the store file at ``path``) and its space's base
    graphs; returns the experiment's id."""
    exp_id = store.add_experiment(config, seed, name=os.path.basename(path))
    record_bases(store, space, exp_id)
    return exp_id


def record_bases(store: Any, space: Any, exp_id: int) -> None:
    """Write each traced base of ``space`` (a :class:`~retiarii.space.ModelSpace`) as JSON;
    spaces without traced bases (a function trainer's) write nothing."""
    bases = getattr(space, "bases", None)
    if not bases or "base_graphs" not in store.db.table_names():
        return
    names = list(getattr(space, "base_names", [])) or [str(i) for i in range(len(bases))]
    with store.db.conn:
        store.db.conn.executemany(
            "INSERT OR REPLACE INTO base_graphs (experiment_id, idx, name, graph, hash) "
            "VALUES (?, ?, ?, ?, ?)",
            [(exp_id, i, names[i], json.dumps(graph.to_data()), graph.structural_hash())
             for i, (graph, _inline) in enumerate(bases)])


def base_graph(db: Any, exp_id: int, sample: dict | None) -> dict | None:
    """The stored base graph a model of ``sample`` was built from (the space's ``base`` choice,
    else its only base), as data; None for files written before base graphs were kept."""
    if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'base_graphs'").fetchone():
        return None
    name = (sample or {}).get("base")
    row = db.execute("SELECT graph FROM base_graphs WHERE experiment_id = ? AND (name = ? OR "
                     "? IS NULL) ORDER BY idx LIMIT 1", [exp_id, name, name]).fetchone()
    return None if row is None else json.loads(row[0])
