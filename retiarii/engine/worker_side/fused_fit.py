"""Which sets of a fusion family fit one fused model: models that differ at places (another
operator at one place, :mod:`retiarii.optim.fused_segments`) fuse only where every place
gives values of one shape, checked on meta tensors shaped like the job's first batch.

Example::

    fitting_sets([("a", "b", "c")], models, runs, inputs)   # [("a", "c")]: b's place differs
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...optim import fusion_key, segments_fit

__all__ = ["fitting_sets"]

_FITS: dict[tuple, bool] = {}  # (architectures, input shapes) -> whether they fit


def _fits(keys: tuple[str, ...], reps: Sequence[Any], inputs: tuple | None) -> bool:
    shapes = None if inputs is None else tuple(
        tuple(a.shape) if hasattr(a, "shape") else repr(a) for a in inputs)
    if (keys, shapes) not in _FITS:
        _FITS[keys, shapes] = segments_fit(reps, inputs)
    return _FITS[keys, shapes]


def fitting_sets(sets: Sequence[tuple[str, ...]], models: Mapping, runs: Mapping,
                 inputs: tuple | None) -> list[tuple[str, ...]]:
    """``sets`` (trials of one fusion family each) split into sets that fit one fused model:
    each architecture (``fusion_key``) joins the first set whose architectures it fits with,
    in input order; without ``inputs`` (no batch to check on) only architectures that differ
    in their activations share a set. Sets of one trial are dropped."""
    out: list[tuple[str, ...]] = []
    for members in sets:
        arch: dict[str, list[str]] = {}
        for t in members:
            arch.setdefault(fusion_key(models[t]), []).append(t)
        if len(arch) == 1:
            out.append(tuple(members))
            continue
        reps = {key: runs[ids[0]].model for key, ids in arch.items()}
        parts: list[list[str]] = []
        for key in arch:
            home = next((p for p in parts if _fits((*p, key), [reps[k] for k in (*p, key)],
                                                   inputs)), None)
            if home is None:
                parts.append([key])
            else:
                home.append(key)
        for part in parts:
            trials = tuple(t for t in members if fusion_key(models[t]) in part)
            if len(trials) > 1:
                out.append(trials)
    return out
