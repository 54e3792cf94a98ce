"""A multi-trial search's named selection as ``experiments.result_model`` (the column a one-shot
search's result fills): the stored model of the sample the strategy selects.

A multi-trial strategy whose method names its own choice has a ``selected() -> sample |
None`` method (:meth:`CompoundScaling.selected
<retiarii.strategies.multi_trial.compound_scaling.CompoundScaling.selected>`: EfficientNet's
best *scaled* model, not the best of both phases); the experiment records it when its
search ends, so that
``retiarii nas run`` retrains that choice (``retiarii/nas_retrain.py``); a strategy that names
none leaves the column empty, and readers fall back to the best model by the metric.

Example::

    record_selection(store, {"scaling/depth": 120, ...})   # -> its model id, or None
"""
from __future__ import annotations

import time
from typing import Any

from ...enums import ModelStatus
from ...sampler import sample_key

__all__ = ["record_selection"]


def record_selection(store: Any, sample: dict | None) -> int | None:
    """Set the current experiment's ``result_model`` to the model of ``sample`` among its
    trained ones; returns its id (None: no sample, or no trained model has it)."""
    if sample is None:
        return None
    key = sample_key(sample)
    ids = [m["id"] for m in store.models(ModelStatus.TRAINED.value) if sample_key(m["sample"]) == key]
    if not ids:
        return None
    with store.transaction():
        store.db.execute("UPDATE experiments SET result_model = ?, updated = ? WHERE id = ?",
                         [ids[0], time.time(), store.experiment_id])
    return ids[0]
