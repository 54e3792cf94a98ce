"""Pure-Python model spaces that speak the sampler protocol of docs/architecture.md.

A test double of ``retiarii.ModelSpace`` for the strategies: ``ToySpace(fn)`` runs ``fn(choose)``,
where ``choose(label, candidates)`` asks the sampler and returns the chosen key, with any
control flow in between (conditional choices, unbounded depth). ``SPACES`` names the spaces the
strategy contract suite runs on; a real ``ModelSpace`` factory can be added there.
"""
from __future__ import annotations

import json
import math
import random
from typing import Any, Callable, Iterator


class ToyModel:
    """What ``ToySpace.sample`` returns: only the sample, no graph."""

    def __init__(self, sample: dict):
        self.sample = sample

    def __repr__(self) -> str:
        return f"ToyModel({self.sample})"


class _Indices:
    """A sampler that follows a list of indices, then takes the first candidate."""

    def __init__(self, prefix: list[int]):
        self.prefix = prefix
        self.taken: list[int] = []
        self.counts: list[int] = []

    def choose(self, label: str, candidates: list, context: dict) -> int:
        pos = len(self.taken)
        index = self.prefix[pos] if pos < len(self.prefix) else 0
        self.taken.append(index)
        self.counts.append(len(candidates))
        return index


class ToySpace:
    """A model space given by a function ``fn(choose)`` that makes its choices.

    Example:
        >>> space = ToySpace(lambda choose: choose("op", ["conv", "pool"]))
        >>> [m.sample for m in space.enumerate()], space.size()
        ([{'op': 'conv'}, {'op': 'pool'}], 2)

    Args:
        fn: calls ``choose(label, candidates)`` (returns the chosen key) as often as it likes;
            a label is chosen at most once per model.
        unbounded: the space has no finite size (``size()`` is ``math.inf``, ``enumerate()``
            is an endless generator).
    """

    def __init__(self, fn: Callable[[Callable[[str, list], Any]], Any], *,
                 unbounded: bool = False):
        self.fn = fn
        self.unbounded = unbounded
        self._size: int | None = None

    def sample(self, sampler) -> ToyModel:
        sample: dict = {}

        def choose(label: str, candidates: list) -> Any:
            if label in sample:
                raise ValueError(f"ToySpace: label {label!r} chosen twice")
            index = sampler.choose(label, list(candidates), dict(sample))
            if isinstance(index, bool) or not isinstance(index, int) \
                    or not 0 <= index < len(candidates):
                raise ValueError(f"ToySpace: sampler returned {index!r} for {label!r} "
                                 f"with {len(candidates)} candidates")
            sample[label] = candidates[index]
            return candidates[index]

        self.fn(choose)
        return ToyModel(sample)

    def replay(self, sample: dict) -> ToyModel:
        def follow(label: str, candidates: list, context: dict) -> int:
            # JSON, not ==: 0, False and 0.0 are different candidates.
            keys = [json.dumps(c) for c in candidates]
            return keys.index(json.dumps(sample[label]))

        model = self.sample(type("Replay", (), {"choose": staticmethod(follow)})())
        if json.dumps(model.sample) != json.dumps(sample):
            raise ValueError(f"ToySpace.replay: {sample} is not a sample of this space")
        return model

    def enumerate(self) -> Iterator[ToyModel]:
        """Every model once, depth-first in candidate order (deterministic)."""
        prefix: list[int] = []
        while True:
            walker = _Indices(prefix)
            yield self.sample(walker)
            # Advance like an odometer: the last choice that still has a next candidate.
            j = len(walker.taken) - 1
            while j >= 0 and walker.taken[j] + 1 >= walker.counts[j]:
                j -= 1
            if j < 0:
                return
            prefix = walker.taken[:j] + [walker.taken[j] + 1]

    def size(self) -> float | int:
        if self.unbounded:
            return math.inf
        if self._size is None:
            self._size = sum(1 for _ in self.enumerate())
        return self._size


# ---- the spaces -----------------------------------------------------------------------------

OPS = ["conv3x3", "conv5x5", "maxpool", "skip"]


def flat_space() -> ToySpace:
    """3 independent choices, 12 models (small enough for a chi-square test)."""

    def fn(choose):
        choose("op", ["conv3x3", "conv5x5", "maxpool"])
        choose("width", [16, 32])
        choose("act", ["relu", "gelu"])

    return ToySpace(fn)


def conditional_space() -> ToySpace:
    """n in {2..5} paths, then one op per path; a conv op also chooses its kernel. 1360 models."""

    def fn(choose):
        n = choose("n_paths", [2, 3, 4, 5])
        for i in range(n):
            if choose(f"op{i}", ["conv", "pool", "skip"]) == "conv":
                choose(f"kernel{i}", [3, 5])

    return ToySpace(fn)


def hparam_space() -> ToySpace:
    """Trainer hyper-parameters as choices (ValueChoice-like): floats, ints, bools, None, and
    keys that are equal in Python but distinct in JSON (0, False, 0.0, None, "0"). 270 models."""

    def fn(choose):
        choose("lr", [0.1, 0.01, 0.001])
        choose("batch_size", [32, 64, 128])
        if choose("optimizer", ["sgd", "adam"]) == "sgd":
            choose("nesterov", [True, False])
        choose("dropout", [0.0, 0.5])
        choose("odd", [0, False, 0.0, None, "0"])

    return ToySpace(fn)


def unbounded_space() -> ToySpace:
    """Layers are added while ``more{i}`` says True: no finite size."""

    def fn(choose):
        i = 0
        while True:
            choose(f"op{i}", ["conv", "pool"])
            if not choose(f"more{i}", [False, True]):
                return
            i += 1

    return ToySpace(fn, unbounded=True)


# ---- the synthetic objective ----------------------------------------------------------------

LRS = [0.1, 0.03, 0.01, 0.003]


def synthetic_space() -> ToySpace:
    """A cell of 2..5 paths, one of 4 ops per path, and a learning rate: 5440 models."""

    def fn(choose):
        n = choose("n_paths", [2, 3, 4, 5])
        for i in range(n):
            choose(f"op{i}", OPS)
        choose("lr", LRS)

    return ToySpace(fn)


def _tables() -> tuple[list[dict], dict, dict]:
    rng = random.Random(2029)  # fixed: the objective is one function for every test and seed
    per_path = [{op: rng.uniform(-0.5, 0.5) for op in OPS} for _ in range(5)]
    pairs = {(a, b): rng.uniform(-0.25, 0.25) for a in OPS for b in OPS}
    lr = {0.1: -0.4, 0.03: 0.1, 0.01: 0.2, 0.003: -0.1}
    return per_path, pairs, lr


_PER_PATH, _PAIRS, _LR = _tables()


def synthetic_score(sample: dict) -> float:
    """A fixed function of the choices: per-path op quality, neighbour interactions, the lr."""
    ops = [sample[f"op{i}"] for i in range(sample["n_paths"])]
    score = sum(_PER_PATH[i][op] for i, op in enumerate(ops))
    score += sum(_PAIRS[a, b] for a, b in zip(ops, ops[1:]))
    return score + _LR[sample["lr"]]


def synthetic_noisy(sample: dict, rng: random.Random, noise: float = 0.1) -> float:
    """The score as a strategy sees it: plus Gaussian noise of standard deviation ``noise``."""
    return synthetic_score(sample) + rng.gauss(0.0, noise)


SPACES: dict[str, Callable[[], Any]] = {
    "flat": flat_space,
    "conditional": conditional_space,
    "hparams": hparam_space,
    "synthetic": synthetic_space,
    "unbounded": unbounded_space,
}
