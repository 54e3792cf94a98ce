"""Progressive search: cells grown block by block, a surrogate ranking the expansions (PNAS, Liu
et al., "Progressive Neural Architecture Search", ECCV 2018)."""
from __future__ import annotations

from typing import Any

from ...sampler import RandomSampler, ReplaySampler, sample_key
from . import pnas_predictor
from .base import Draw, Strategy, draw
from .predictor import SURROGATES, Encoder, neighbour, rank

# "ensemble": PNAS's own surrogate (pnas_predictor.py), over the blocks' tokens
PROGRESSIVE_SURROGATES = (*SURROGATES, "ensemble")


class Progressive(Strategy):
    """PNAS's search: evaluate the best ``beam`` cells of b blocks, expand them to b + 1.

    The space says how deep a model is with one choice, ``depth_label`` (its candidates listed
    from shallow to deep, e.g. ``"blocks"`` in ``[1, 2, 3, 4, 5]``); the choices of block i
    exist only when the depth reaches it. Stage 0 proposes ``beam`` random models of the first
    depth. Stage s > 0 takes the ``beam`` best told models of depth s - 1 (the proposed ones
    while none is told), draws ``n_candidates`` expansions of them (the parent's choices kept,
    the depth one step deeper, the new block's choices random), ranks the new ones with a
    surrogate fitted on every told result (:func:`~retiarii.strategies.multi_trial.predictor.rank`; PNAS
    uses an LSTM or MLP ensemble) and proposes the ``beam`` best. PNAS stops there; here the
    deepest stage then repeats while budget remains, its candidates half expansions and half
    neighbours (one choice changed) of the best deepest models, ranked by a refitted
    surrogate.

    A space without ``depth_label`` has one stage: ranked random models, then ranked random
    models and neighbours of the best, ``beam`` at a time.
    The state (stage, queue of ranked proposals) is JSON and survives a resume.

    Example:
        >>> from retiarii.strategies import Progressive
        >>> class Space:
        ...     ops = ["conv", "pool", "skip"]
        ...     def sample(self, sampler):
        ...         s = {"blocks": [1, 2, 3][sampler.choose("blocks", [1, 2, 3], {})]}
        ...         for i in range(s["blocks"]):
        ...             s[f"op{i}"] = self.ops[sampler.choose(f"op{i}", self.ops, dict(s))]
        ...         return type("Model", (), {"sample": s})()
        >>> s = Progressive(seed=0, beam=3)
        >>> depths = []
        >>> for _ in range(9):
        ...     sample = s.ask(Space())
        ...     depths.append(sample["blocks"])
        ...     s.tell(sample, sum(op == "conv" for op in list(sample.values())[1:]))
        >>> depths
        [1, 1, 1, 2, 2, 2, 3, 3, 3]

    Args:
        depth_label: the choice whose candidates are the depths, shallow to deep.
        beam: K, models evaluated per stage and parents kept (PNAS: 256 on CIFAR-10).
        n_candidates: expansions drawn and ranked per stage.
        surrogate: ``"gbt"`` (default) or ``"mlp"`` over the one-hot choices (see
            :func:`~.predictor.fit_surrogate`), or ``"ensemble"``: PNAS's MLP ensemble over
            the blocks' tokens (:mod:`.pnas_predictor`; labels ``"<block>/<field>"``).
        seed: seeds the generator (equal seeds, equal searches in any process).
        mode, dedup, max_models, max_time, clock: see :class:`~retiarii.strategies.Strategy`.
    """

    accepts_foreign = True
    max_duplicate_tries = 4

    def __init__(self, *, depth_label: str = "blocks", beam: int = 8, n_candidates: int = 100,
                 surrogate: str = "gbt", seed: int | None = None, **common: Any):
        super().__init__(seed=seed, **common)
        if not isinstance(beam, int) or beam < 1:
            raise ValueError(f"Progressive: beam must be a positive int, got {beam!r}")
        if not isinstance(n_candidates, int) or n_candidates < beam:
            raise ValueError(f"Progressive: n_candidates must be an int >= beam={beam}, "
                             f"got {n_candidates!r}")
        if surrogate not in PROGRESSIVE_SURROGATES:
            raise ValueError(f"Progressive: surrogate must be one of {PROGRESSIVE_SURROGATES}, "
                             f"got {surrogate!r}")
        self.depth_label, self.beam = depth_label, beam
        self.n_candidates, self.surrogate = n_candidates, surrogate
        self._stage = -1  # the stage whose proposals are queued (-1: none yet)
        self._queue: list[dict] = []  # ranked proposals of the stage, best first

    # -- the stages ---------------------------------------------------------------------------

    def _depths(self, space: Any) -> list | None:
        """The depth label's candidates, or None when the space has no such choice."""
        for label, candidates in self._random_draw(space).trace or ():
            if label == self.depth_label:
                return list(candidates)
        return None

    def _at_depth(self, space: Any, index: int, parent: dict | None) -> Draw:
        """A model of depth ``depths[index]``: ``parent``'s choices kept, new ones random."""
        force = {self.depth_label: lambda candidates, old: index}
        return draw(space, ReplaySampler(parent or {}, fallback=RandomSampler(self._rng),
                                         overrides=force))

    def _depth_of(self, sample: dict, depths: list) -> int | None:
        value = sample.get(self.depth_label)
        return next((i for i, d in enumerate(depths) if sample_key({"d": d}) ==
                     sample_key({"d": value})), None)

    def _beam_of(self, depths: list | None, index: int) -> list[dict]:
        """The ``beam`` best told models of depth ``depths[index]`` (of any depth when the
        space has none); the proposed ones while none is told."""
        told = [(s, v) for s, v in self._observations()
                if depths is None or self._depth_of(s, depths) == index]
        if told:
            order = sorted(range(len(told)), key=lambda i: (-told[i][1], i))
            return [told[i][0] for i in order[:self.beam]]
        return [r.sample for r in self._records.values() if r.proposed and (
            depths is None or self._depth_of(r.sample, depths) == index)][:self.beam]

    def _fill(self, space: Any) -> None:
        depths = self._depths(space)
        last = 0 if depths is None else len(depths) - 1
        stage = min(self._stage + 1, last)
        parents = self._beam_of(depths, stage - 1) if depths and stage > 0 else []
        # Past the deepest stage, half the candidates are neighbours of the best deepest
        # models (one choice changed): the beam's early blocks are fixed, so without them the
        # search would only re-expand the same parents.
        best = self._beam_of(depths, last) if self._stage == last else []
        candidates, seen = [], set()
        for i in range(self.n_candidates):
            if best and i % 2:
                c = neighbour(self, space, sample_key(best[(i // 2) % len(best)]))
            elif depths is None:
                c = self._random_draw(space)
            else:
                c = self._at_depth(space, stage, parents[i % len(parents)] if parents else None)
            key = sample_key(c.sample)
            if key not in seen and key not in self._records:
                seen.add(key)
                candidates.append(c)
        told = list(self._observations())
        if len(told) >= 2 and candidates and self.surrogate == "ensemble":
            # refitted at every level on every told cell: the mean of the MLP ensemble
            order = pnas_predictor.rank_by_ensemble(told, [c.sample for c in candidates],
                                                    self._rng.randrange(2 ** 31))
            candidates = [candidates[i] for i in order]
        elif len(told) >= 2 and candidates:
            encoder = Encoder()
            for key, value in self._told:
                if value is not None:
                    encoder.add(self._trace(key, space))
            order = rank(encoder, told, candidates, self.surrogate, self._rng.randrange(2 ** 31))
            candidates = [candidates[i] for i in order]
        self._stage = stage
        self._queue = [c.sample for c in candidates[:self.beam]]

    def _propose(self, space: Any) -> Draw:
        while self._queue and sample_key(self._queue[0]) in self._records:
            self._queue.pop(0)  # proposed meanwhile (a foreign tell): skip it
        if not self._queue:
            self._fill(space)
        if not self._queue:  # no new expansion: the base class falls back to random
            return self._random_draw(space)
        return draw(space, ReplaySampler(self._queue.pop(0)))

    def config(self) -> dict:
        return {**super().config(), "depth_label": self.depth_label, "beam": self.beam,
                "n_candidates": self.n_candidates, "surrogate": self.surrogate}

    def _state(self) -> dict:
        return {"stage": self._stage, "queue": [dict(s) for s in self._queue]}

    def _load_state(self, state: dict) -> None:
        self._stage = state["stage"]
        self._queue = [dict(s) for s in state["queue"]]
