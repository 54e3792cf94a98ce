"""The operator-table latencies `retiarii nas run` hands Single-Path NAS and Once-for-All:
the base model's predicted latency and OFA's per-slot lookup, kept in the run's store."""
from __future__ import annotations

import os
from typing import Any


def base_latency(presets: Any, preset: str, store: str) -> float:
    """The predicted latency (ms) of the base model (every choice at its first candidate) of
    ``getattr(presets, preset)`` (a row's ``nas.SPACES.<name>``) by the operator table kept
    in ``store``."""
    from .engine.op_latency import OpLatencyTable
    from .engine.store import Store

    space = getattr(presets, preset)
    with Store(store) as db:
        return OpLatencyTable(db).predict(
            space.instantiate(space.default_sample()).to_module(), space.example_input[:1])


def elastic_table(presets: Any, preset: str, store: str) -> dict:
    """Once-for-All's latency lookup of ``getattr(presets, preset)`` (see
    :func:`retiarii.strategies.once_for_all.ofa_latency_table`) from the operator table kept
    in ``store``."""
    from .engine.op_latency import OpLatencyTable
    from .engine.store import Store
    from .strategies.once_for_all import ofa_latency_table

    os.makedirs(os.path.dirname(os.path.abspath(store)), exist_ok=True)
    with Store(store) as db:
        return ofa_latency_table(getattr(presets, preset), OpLatencyTable(db))
