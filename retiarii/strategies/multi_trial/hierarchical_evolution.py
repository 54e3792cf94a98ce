"""The mutation of hierarchical representations (Liu et al., ICLR 2018): pick a level, a motif
of that level, a successor node, a predecessor, and replace the operation on that edge."""
from __future__ import annotations

from typing import Any

from ...sampler import RandomSampler, ReplaySampler, index_of
from .base import Draw, draw
from .evolution import RegularizedEvolution


def pick_edge(labels: list[str], levels: dict[str, int], rng) -> str:
    """The label of the edge to mutate among ``labels`` ``"<motif>/<i>-<j>"``: a level drawn
    uniformly among ``levels``' values, then a motif of that level, a successor node j of
    the motif, a predecessor i < j, each uniformly.

    Example:
        >>> import random
        >>> pick_edge(["m1/0-1", "m1/0-2", "m1/1-2", "cell/0-1"], {"m1": 2, "cell": 3},
        ...           random.Random(1))
        'm1/0-2'
    """
    motifs: dict[str, list[tuple[int, int]]] = {}
    for label in labels:
        motif, _, pair = label.partition("/")
        if motif in levels:
            i, j = map(int, pair.split("-"))
            motifs.setdefault(motif, []).append((i, j))
    level = sorted({levels[m] for m in motifs})[rng.randrange(len({levels[m] for m in motifs}))]
    motif = sorted(m for m in motifs if levels[m] == level)
    motif = motif[rng.randrange(len(motif))]
    successors = sorted({j for _, j in motifs[motif]})
    j = successors[rng.randrange(len(successors))]
    predecessors = sorted(i for i, k in motifs[motif] if k == j)
    i = predecessors[rng.randrange(len(predecessors))]
    return f"{motif}/{i}-{j}"


class HierarchicalEvolution(RegularizedEvolution):
    """Aging evolution whose mutation is the paper's: one edge of one motif of one level gets
    a different operation (or ``none``), the level, motif, successor and predecessor drawn
    uniformly in that order (:func:`pick_edge`), not one label among all.

    The initial population is the paper's: with ``initial="base"`` each member is the trivial
    genotype (every choice at its first candidate) diversified by ``diversify`` random
    mutations of that kind (the paper: 200 genotypes, 1000 mutations each); children then
    change one edge of their parent. ``diversify=0`` grows the population as
    :class:`RegularizedEvolution` does from the base (the base, then one-edge children of it).

    Args:
        levels: the level of each motif, by the prefix of its labels (``{"motif1": 2, ...,
            "cell": 3}`` for model_spaces/hierarchical.py).
        diversify: random mutations applied to the trivial genotype for each member of the
            initial population (``initial="base"`` only).
        population_size, sample_size, initial, seed, ...: see :class:`RegularizedEvolution`.
    """

    def __init__(self, population_size: int = 20, sample_size: int = 5, *,
                 levels: dict[str, int], initial: str = "random", diversify: int = 1000,
                 seed: int | None = None, **common: Any):
        super().__init__(population_size, sample_size, initial=initial, seed=seed, **common)
        if not levels or not all(isinstance(v, int) for v in levels.values()):
            raise ValueError(f"HierarchicalEvolution: levels maps each motif's label prefix "
                             f"to its level (an int), got {levels!r}")
        if not isinstance(diversify, int) or diversify < 0:
            raise ValueError(f"HierarchicalEvolution: diversify is a count of mutations "
                             f"(0 or more; the paper: 1000), got {diversify!r}")
        self.levels, self.diversify = dict(levels), diversify

    def _from_base(self, space: Any) -> Draw:
        if not self.diversify:
            return super()._from_base(space)
        candidates = _Candidates()
        genotype = draw(space, candidates).sample  # the trivial genotype
        for _ in range(self.diversify):
            label = pick_edge(list(genotype), self.levels, self._rng)
            options = candidates.of[label]
            others = [c for c in options if c != genotype[label]]
            genotype[label] = others[self._rng.randrange(len(others))]
        # replayed: a choice the genotype lacks is drawn, one it holds but the model does
        # not reach leaves the sample (the space's own rules)
        return draw(space, ReplaySampler(genotype, fallback=RandomSampler(self._rng)))

    def _mutate(self, space: Any, parent_key: str) -> Draw:
        parent = self._records[parent_key].sample
        target = pick_edge(list(parent), self.levels, self._rng)

        def mutate(candidates: list, old_key: Any) -> int:
            old = index_of(candidates, old_key)
            others = [i for i in range(len(candidates)) if i != old]
            return others[self._rng.randrange(len(others))]

        child = draw(space, ReplaySampler(parent, fallback=RandomSampler(self._rng),
                                          overrides={target: mutate}))
        child.parent = dict(parent)
        return child

    def config(self) -> dict:
        config = {**super().config(), "levels": self.levels}
        if self.initial == "base" and self.diversify:  # (states saved before it still load)
            config["diversify"] = self.diversify
        return config


class _Candidates:
    """Every choice at its first candidate, recording each label's candidates."""

    def __init__(self):
        self.of: dict[str, list] = {}

    def choose(self, label: str, candidates: list, context: dict) -> int:
        self.of[label] = list(candidates)
        return 0
