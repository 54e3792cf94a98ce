"""One model drawn from a space: its sample and the candidates of every choice it reached.

A strategy proposes a :class:`Draw`; :func:`draw` builds one by letting a sampler decide each
choice of ``space.sample`` while a recorder notes ``(label, candidates)`` in order, so the
strategy learns the choices of a conditional space as they appear.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ...sampler import Sampler

__all__ = ["Draw", "check_sample", "draw"]


def check_sample(sample: Any, where: str) -> dict:
    """``sample`` if it is a JSON-serializable dict ``label -> key``, else a ``TypeError``
    naming ``where`` it came from."""
    if not isinstance(sample, dict):
        raise TypeError(f"{where}: a sample is a dict label -> key, got {type(sample).__name__}")
    try:
        json.dumps(sample)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where}: the sample {sample!r} is not JSON-serializable ({e}); keys "
                        f"of candidates must be JSON scalars") from None
    return sample


class _Recorder:
    """Wraps a sampler and records ``(label, candidates)`` of every choice, in order."""

    def __init__(self, inner: Sampler):
        self.inner = inner
        self.trace: list[tuple[str, list]] = []

    def choose(self, label: str, candidates: list, context: dict) -> int:
        candidates = list(candidates)
        self.trace.append((label, candidates))
        index = self.inner.choose(label, candidates, context)
        if isinstance(index, bool) or not isinstance(index, int) \
                or not 0 <= index < len(candidates):
            raise ValueError(f"sampler {type(self.inner).__name__} returned {index!r} for "
                             f"{label!r}; it must be an int index into {candidates}")
        return index


@dataclass
class Draw:
    """A proposed sample and the candidates of each of its choices (``trace``: a list of
    ``(label, candidates)``, or ``None`` where not known, e.g. for enumerated models)."""

    sample: dict
    trace: list[tuple[str, list]] | None
    # the sample this one was derived from (a mutation), if any
    parent: dict | None = field(default=None, repr=False)


def draw(space: Any, sampler: Sampler) -> Draw:
    """Builds one model of ``space`` with ``sampler`` and returns its sample and trace.

    Example:
        >>> from retiarii.sampler import ReplaySampler
        >>> class Space:   # any object with sample(sampler) -> object with .sample
        ...     def sample(self, sampler):
        ...         i = sampler.choose("op", ["a", "b"], {})
        ...         return type("Model", (), {"sample": {"op": ["a", "b"][i]}})()
        >>> draw(Space(), ReplaySampler({"op": "b"}))
        Draw(sample={'op': 'b'}, trace=[('op', ['a', 'b'])])

    Args:
        space: anything with ``sample(sampler)`` returning an object with ``.sample``.
        sampler: decides each choice.
    """
    recorder = _Recorder(sampler)
    model = space.sample(recorder)
    sample = check_sample(getattr(model, "sample", None),
                          f"{type(space).__name__}.sample() returned a model whose .sample")
    return Draw(dict(sample), recorder.trace)
