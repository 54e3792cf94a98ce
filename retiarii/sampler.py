"""Samples and samplers: who decides each choice of a space, and how a sample is compared.

A *sample* maps a choice's label to the key of its chosen candidate (docs/architecture.md). A
*sampler* decides the choices one at a time: ``space.sample(sampler)`` calls
``sampler.choose(label, candidates, context) -> int`` for every choice it reaches. The space
(replay, enumeration) and the strategies (random draws, replay with a fallback, mutation of a
parent) all use the samplers of this one module, so a sample means the same model everywhere:
in the strategy that proposed it, in the driver that checked its shapes and in the worker that
trains it.

This module imports nothing from retiarii: it sits below ``space.py`` and ``strategies/``.

Example:
    >>> ReplaySampler({"x": True}).choose("x", [1, True, 1.0], {})
    1
"""
from __future__ import annotations

import json
import random
from typing import Any, Callable, Iterator, Protocol, Sequence


class SampleError(ValueError):
    """A sample that does not fit the space (unknown label, value not among candidates)."""


class Sampler(Protocol):
    def choose(self, label: str, candidates: list, context: dict) -> int:
        """Index into ``candidates`` (their keys) for the choice ``label``; ``context`` is the
        sample so far."""


# ---- comparing samples and keys -------------------------------------------------------------


def sample_key(sample: dict) -> str:
    """A canonical string for a sample, equal for equal choices whatever their order.

    Example:
        >>> sample_key({"b": 1, "a": "conv"}) == sample_key({"a": "conv", "b": 1})
        True
    """
    # NOTE: keys are compared through JSON, never with ==, because 1 == 1.0 == True in Python
    # while they are three different candidates of a choice.
    return json.dumps(sample, sort_keys=True, separators=(",", ":"))


def index_of(candidates: list, key: Any) -> int | None:
    """The index of ``key`` among ``candidates`` (compared as JSON, see :func:`sample_key`),
    or ``None``.

    Example:
        >>> index_of([1, True, 1.0], True)
        1
    """
    wanted = json.dumps(key)
    for i, candidate in enumerate(candidates):
        if json.dumps(candidate) == wanted:
            return i
    return None


# ---- samplers -------------------------------------------------------------------------------


def as_sampler(sampler: Any) -> Sampler:
    """``sampler`` itself if it has ``choose``; a plain ``f(label, candidates, context)``
    wrapped into one."""
    if hasattr(sampler, "choose"):
        return sampler
    if callable(sampler):
        class _Fn:
            def choose(self, label, candidates, context):
                return sampler(label, candidates, context)
        return _Fn()
    raise TypeError(f"a sampler has a choose(label, candidates, context) method or is such a "
                    f"callable; got {sampler!r}")


class RandomSampler:
    """Picks every choice uniformly at random.

    Example:
        >>> RandomSampler(0).choose("op", ["a", "b", "c"], {}) in (0, 1, 2)
        True

    Args:
        rng: a ``random.Random`` to draw from (a strategy shares its own, so its state decides
            the draws), or a seed for a new one (``None``: seeded by the OS).
    """

    def __init__(self, rng: random.Random | int | None = None):
        self.rng = rng if isinstance(rng, random.Random) else random.Random(rng)

    def choose(self, label: str, candidates: list, context: dict) -> int:
        return self.rng.randrange(len(candidates))


class ReplaySampler:
    """Answers every choice from ``sample``; keys are compared as JSON, so a choice among
    ``[1, True, 1.0]`` replays ``True`` as ``True``.

    Without a ``fallback`` the sample must decide every choice the space asks for (replaying a
    model exactly); with one, choices the sample does not decide (they did not exist when it
    was made, or its key is no longer a candidate) are asked of the fallback. ``used`` holds the
    labels answered from the sample.

    Example:
        >>> ReplaySampler({"op": "b"}).choose("op", ["a", "b"], {})
        1

    Args:
        sample: label -> chosen key.
        fallback: decides the choices ``sample`` does not.
        overrides: label -> ``f(candidates, key_in_sample) -> int`` that decides that choice
            instead (how evolution mutates one choice).

    Raises:
        SampleError: (without a fallback) the sample has no value for a choice, or its value is
            not among the candidates.
    """

    def __init__(self, sample: dict, fallback: Sampler | None = None,
                 overrides: dict[str, Callable[[list, Any], int]] | None = None):
        if not isinstance(sample, dict):
            raise SampleError(f"a sample is a dict of label -> chosen key, not {sample!r}")
        self.sample = sample
        self.fallback = fallback
        self.overrides = overrides or {}
        self.used: set[str] = set()

    def choose(self, label: str, candidates: list, context: dict) -> int:
        if label in self.overrides:
            return self.overrides[label](candidates, self.sample.get(label))
        index = index_of(candidates, self.sample[label]) if label in self.sample else None
        if index is not None:
            self.used.add(label)
            return index
        if self.fallback is not None:
            return self.fallback.choose(label, candidates, context)
        if label not in self.sample:
            raise SampleError(f"the sample has no value for choice {label!r} (candidates "
                              f"{candidates}); it was made for another space")
        raise SampleError(f"choice {label!r}: {self.sample[label]!r} is not among the "
                          f"candidates {candidates}")


class PrefixSampler:
    """Answers choice i with ``prefix[i]`` (0 past the prefix) and records every choice's arity:
    how a space walks its tree of choices (enumeration, counting)."""

    def __init__(self, prefix: Sequence[int]):
        self.prefix = prefix
        self.arity: list[int] = []
        self.labels: list[str] = []

    def choose(self, label: str, candidates: list, context: dict) -> int:
        i = len(self.arity)
        self.arity.append(len(candidates))
        self.labels.append(label)
        return self.prefix[i] if i < len(self.prefix) else 0


def walk_choices(run: Callable[[list[int]], tuple[Any, list[int]]]) -> Iterator[Any]:
    """Every model of a finite tree of choices, once each, in a deterministic order (the
    leftmost first): ``run(prefix)`` samples with a :class:`PrefixSampler` over ``prefix`` and
    returns (the model, the arity of each choice it reached)."""
    prefix: list[int] = []
    while True:
        model, arity = run(prefix)
        yield model
        full = prefix + [0] * (len(arity) - len(prefix))
        j = len(full) - 1
        while j >= 0 and full[j] + 1 >= arity[j]:
            j -= 1
        if j < 0:
            return
        prefix = full[:j] + [full[j] + 1]
