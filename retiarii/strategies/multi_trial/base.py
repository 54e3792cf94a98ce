"""The strategy interface: ask for a sample, tell its result, save and restore the search.

A strategy is *instantiation control*: it decides, choice by choice, which model of a space is
built next. It never knows what a choice means. It drives the space only through the sampler
protocol of ``docs/architecture.md``: ``space.sample(sampler)`` calls
``sampler.choose(label, candidates, context) -> int`` for every choice it reaches (so
conditional choices only appear when they exist) and returns a model whose ``.sample`` is the
ordered dict ``label -> key``. Which base model a space starts from is, for a space with several
bases, one more choice like any other, so it needs no extra call.

Every algorithm (one per file) subclasses :class:`Strategy` and fills in three hooks:
``_propose(space) -> Draw`` (the next candidate sample), ``_on_tell(key, score)`` (learn from a
result, ``score`` always higher-is-better) and ``_state`` / ``_load_state`` for its own JSON
state. The base class does everything the algorithms share: ``mode``, dedup of proposed samples,
the ``max_models`` / ``max_time`` budget, bookkeeping of pending and told samples, errors for
foreign samples, and the JSON state that lets a resumed experiment continue the same search.

Training control (continue / pause / stop / start from a parent's checkpoint) is the other half
of steering, and belongs to the schedulers; the engine combines one of each.
"""
from __future__ import annotations

import abc
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ...enums import Mode
from ...objectives import Scored, pareto_indices
from ...sampler import RandomSampler, ReplaySampler, sample_key

from ..schedulers.base import replay_log
from .compact_state import TraceTable, rng_from_json, rng_to_json
from .draws import Draw, check_sample, draw  # (Draw and draw: imported from here too)


class SpaceExhausted(Exception):
    """The strategy has nothing new to propose: the space, or the budget, is used up."""


class BudgetExhausted(SpaceExhausted):
    """``max_models`` or ``max_time`` is reached (a :class:`SpaceExhausted`, so one ``except``
    catches both ways a search ends)."""


class UnknownSample(ValueError):
    """``tell`` or ``on_step`` of a sample this strategy has not proposed (or already told).

    The engine expects it after a resume: a trial that outlived the driver may report a sample
    the restored strategy has not proposed again yet (it learns the value when it does)."""


# ---- the base class -------------------------------------------------------------------------

#: Version of :meth:`Strategy.state_dict`'s layout (2: records kept as an append-only log).
STATE_FORMAT = 2


@dataclass
class _Record:
    """What the strategy knows about one distinct sample."""

    sample: dict
    trace: int | None  # index into Strategy._traces, or None (foreign or enumerated)
    pending: int = 0  # proposed and not yet told (more than 1 only with dedup=False)
    values: list = field(default_factory=list)  # told values (None = the model failed)
    proposed: bool = True  # False for a foreign sample told without being proposed


class Strategy(abc.ABC):
    """Base of every exploration strategy: ask / tell, dedup, budget, JSON state.

    Example (with any concrete strategy and any space):
        >>> from retiarii.strategies import Random
        >>> class Space:
        ...     def sample(self, sampler):
        ...         i = sampler.choose("op", ["conv", "pool"], {})
        ...         return type("Model", (), {"sample": {"op": ["conv", "pool"][i]}})()
        ...     def size(self):
        ...         return 2
        >>> s = Random(seed=0)
        >>> sample = s.ask(Space())
        >>> s.tell(sample, 0.9)
        >>> s.ask(Space()) != sample      # never the same sample twice (dedup=True)
        True

    Args:
        seed: seeds the strategy's random generator; equal seeds give equal searches, in any
            process. ``None`` draws a seed from the OS (the state still saves and restores).
        mode: ``"max"`` (default, a higher value is better) or ``"min"``.
        dedup: never propose a sample already proposed (default). ``False`` allows repeats,
            e.g. to re-evaluate a noisy model.
        max_models: raise :class:`BudgetExhausted` once this many samples were proposed.
        max_time: raise :class:`BudgetExhausted` once this many seconds passed since the first
            ``ask`` (time while the strategy was saved and not running does not count).
        clock: the time source for ``max_time`` (seconds); tests pass a fake one.
    """

    #: Whether ``tell`` takes samples this strategy never proposed (they join its history).
    accepts_foreign: bool = False
    #: Proposals in a row that may repeat a known sample before falling back to a random new
    #: one; ``None`` for strategies that walk the space and never repeat (grid).
    max_duplicate_tries: int | None = 100
    #: Whether the strategy searches several objectives at once (:meth:`use_objectives`).
    multi_objective: bool = False

    def __init__(self, *, seed: int | None = None, mode: str = "max", dedup: bool = True,
                 max_models: int | None = None, max_time: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if max_models is not None and (not isinstance(max_models, int) or max_models < 1):
            raise ValueError(f"{type(self).__name__}: max_models must be a positive int or "
                             f"None, got {max_models!r}")
        if max_time is not None and not max_time > 0:
            raise ValueError(f"{type(self).__name__}: max_time must be positive seconds or "
                             f"None, got {max_time!r}")
        self.seed = seed
        self.mode = Mode.parse(mode, type(self).__name__)
        self.dedup = dedup
        self.max_models = max_models
        self.max_time = max_time
        self._clock = clock
        self._rng = random.Random(seed)
        self._records: dict[str, _Record] = {}
        self._told: list[tuple[str, float | None]] = []  # (sample key, value) in tell order
        # What happened to the records, in order (see state_dict); only ever appended to.
        self._log: list[list] = []
        self._record_ids: dict[str, int] = {}  # sample key -> its index in creation order
        self._table = TraceTable()  # the records' traces, interned
        self._num_proposed = 0
        # sample key -> the sample it was derived from, for proposals of this process (the
        # engine records it as the model's parent right after ask; not part of the state)
        self._parents: dict[str, dict] = {}
        self._elapsed_before = 0.0
        self._started_at: float | None = None
        self._checked: int | None = None  # id() of the space check() accepted
        self._size: tuple[int, float | int] | None = None  # (id(space), space.size())
        # several objectives' directions and names (use_objectives; _on_tell gets a Scored)
        self.objectives: tuple[Mode, ...] | None = None
        self.objective_names: tuple[str, ...] | None = None  # None: one metric, or not given

    def use_objectives(self, modes: Iterable[str | Mode], names: Iterable[str] | None = None):
        """Search several objectives, ``modes[i]`` the direction of the i-th (``names[i]``
        its metric's name): each ``tell`` then gives a list of as many values (and the
        constraints' violation). The engine calls it for ``Experiment(metric=[...], ...)``.

        Raises:
            ValueError: this strategy optimizes one metric (naming those that take several).
        """
        modes = tuple(Mode.parse(m, type(self).__name__) for m in modes)
        if not self.multi_objective:
            raise ValueError(f"{type(self).__name__} optimizes one metric; for several "
                             f"objectives use RegularizedEvolution, TPE (MOTPE), Predictor, "
                             f"PolicyBasedRL(reward=...), Random or GridSearch")
        if len(modes) < 2:
            raise ValueError(f"{type(self).__name__}.use_objectives: give two modes or more "
                             f"(one metric needs no objectives; use mode=)")
        self.objectives, self.objective_names = modes, None if names is None else tuple(names)

    # -- the public interface ----------------------------------------------------------------

    def check(self, space: Any) -> None:
        """Raises a clear error now if this strategy cannot search ``space``.

        ``ask`` calls it on first use; the engine may call it before it launches anything.
        """
        if not callable(getattr(space, "sample", None)):
            raise TypeError(f"{type(self).__name__} needs a space with sample(sampler) (a "
                            f"retiarii.ModelSpace); got {type(space).__name__}")
        self._checked = id(space)

    def ask(self, space: Any) -> dict:
        """Proposes the next sample (``label -> key``) of ``space``.

        Raises:
            SpaceExhausted: nothing new is left to propose.
            BudgetExhausted: ``max_models`` or ``max_time`` is reached.
        """
        if self._checked != id(space):
            self.check(space)
        if self._started_at is None:
            self._started_at = self._clock()
        self._check_budget()
        tries = 0
        while True:
            proposal = self._propose(space)
            key = sample_key(proposal.sample)
            if not (self.dedup and key in self._records):
                break
            tries += 1
            if tries == 1 and len(self._records) >= self._space_size(space):
                raise SpaceExhausted(f"{type(self).__name__}: all {len(self._records)} models "
                                     f"of the space were proposed")
            if self.max_duplicate_tries is not None and tries >= self.max_duplicate_tries:
                proposal, key = self._new_at_random(space, tries)
                break
        self._record(proposal, key)
        return dict(proposal.sample)

    def tell(self, sample: dict, value: float | list[float] | None,
             violation: float = 0.0) -> None:
        """Reports the final result of a proposed sample.

        Args:
            sample: a sample returned by :meth:`ask`.
            value: the model's final metric (higher is better unless ``mode="min"``), or
                ``None`` when the model failed: it is never proposed again and counts as
                worse than any result. With several objectives (:meth:`use_objectives`), a
                list of one value per objective.
            violation: by how much the model misses the search's constraints (0: it meets
                them; :meth:`retiarii.objectives.Objectives.violation`).
        """
        sample = check_sample(sample, f"{type(self).__name__}.tell")
        if not (isinstance(violation, (int, float)) and violation >= 0):
            raise ValueError(f"{type(self).__name__}.tell: violation must be a number >= 0, "
                             f"got {violation!r}")
        if self.objectives is not None and value is not None:
            value = self._check_values(value, sample)
        elif value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise ValueError(f"{type(self).__name__}.tell: value must be a finite number "
                                 f"(or None for a failed model), got {value!r} for {sample}")
            value = float(value)
        key = sample_key(sample)
        record = self._records.get(key)
        if record is None or record.pending == 0:
            if not self.accepts_foreign:
                what = "never proposed" if record is None else "already told"
                raise UnknownSample(
                    f"{type(self).__name__}.tell: {sample} was {what}; tell each sample "
                    f"returned by ask() exactly once (RegularizedEvolution and TPE accept "
                    f"foreign samples)")
            if record is None:
                record = self._new_record(key, _Record(dict(sample), None, proposed=False))
        else:
            record.pending -= 1
        record.values.append(value)
        self._told.append((key, value))
        # the violation only when there is one: logs of searches without constraints unchanged
        self._log.append(["tell", self._record_ids[key], value, *([violation] if violation
                                                                  else [])])
        self._on_tell(key, None if value is None else self._score(value, violation))

    def _check_values(self, value: Any, sample: dict) -> list[float]:
        n = len(self.objectives)
        if not isinstance(value, (list, tuple)) or len(value) != n or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                for v in value):
            raise ValueError(f"{type(self).__name__}.tell: with {n} objectives, value must be "
                             f"a list of {n} finite numbers (or None for a failed model), got "
                             f"{value!r} for {sample}")
        return [float(v) for v in value]

    def on_step(self, sample: dict, step: int, metrics: dict) -> None:
        """Per-step feedback of a pending sample (an epoch's metrics). The strategies here
        decide from final results only; a strategy that learns from curves overrides this."""
        key = sample_key(check_sample(sample, f"{type(self).__name__}.on_step"))
        if key not in self._records:
            raise UnknownSample(f"{type(self).__name__}.on_step: {sample} was never proposed")

    def best(self) -> tuple[dict, float] | None:
        """The best told sample and its value (``None`` before any successful tell); with
        several objectives, the front is the result: see :meth:`pareto`."""
        if self.objectives is not None:
            front = self.pareto()
            return front[0] if front else None
        told = [(k, v) for k, v in self._told if v is not None]
        if not told:
            return None
        key, value = max(told, key=lambda kv: self._score(kv[1]))
        return dict(self._records[key].sample), value

    def pareto(self) -> list[tuple[dict, list[float]]]:
        """With several objectives: the told samples on the Pareto front (feasible and
        dominated by none), with their values, in the order they were told."""
        if self.objectives is None:
            raise ValueError(f"{type(self).__name__}.pareto: the search has one metric; "
                             f"use best()")
        told = [k for k, v in self._told if v is not None]
        violations = self._violations()
        points = [self._score(self._records[k].values[-1]).point for k in told]
        keep = pareto_indices(points, [violations.get(k, 0.0) for k in told])
        return [(dict(self._records[told[i]].sample), list(self._records[told[i]].values[-1]))
                for i in keep]

    def _violations(self) -> dict[str, float]:
        """sample key -> the violation of its last tell (from the log: kept nowhere else)."""
        keys = list(self._record_ids)
        return {keys[e[1]]: (e[3] if len(e) > 3 else 0.0) for e in self._log if e[0] == "tell"}

    def parent_of(self, sample: dict) -> dict | None:
        """The sample that ``sample`` (returned by :meth:`ask`) was derived from (evolution's
        parent), or ``None`` for a sample drawn afresh."""
        parent = self._parents.get(sample_key(sample))
        return None if parent is None else dict(parent)

    def random_startup(self) -> tuple[int, str] | None:
        """``(n, why)``: the strategy proposes its first ``n`` models at random before its own
        rule applies (``why`` names the setting, ``"population_size=16"``); None for a strategy
        that never learns from results (random, grid). An experiment whose budget does not
        pass the start-up warns once at start (it would be a random search)."""
        return None

    def config(self) -> dict:
        """The settings that define this search, as JSON: a saved state must match them, and
        an experiment stores them so that a resume can check them. Subclasses extend it."""
        config = {"mode": self.mode, "dedup": self.dedup}
        if self.objectives is not None:  # (left out for one metric: older states still load)
            config["objectives"] = [str(m) for m in self.objectives]
        return config

    @property
    def num_proposed(self) -> int:
        """How many samples ``ask`` returned so far."""
        return self._num_proposed

    def state_dict(self) -> dict:
        """The whole search state as JSON-serializable data (for the store).

        What the strategy knows of each sample is kept as a log of events, ``["new", sample,
        trace, proposed]`` (a record is created; records are numbered in creation order),
        ``["ask", record]``, ``["tell", record, value]`` and ``["trace", record, trace]`` (a
        trace learnt later), from which :meth:`load_state_dict` rebuilds the records. The log,
        ``candidate_lists`` and ``traces`` only ever grow at their end, and ``append_only``
        names them: a store saves just their new items (the state of a long search is saved
        after every model, in time that does not grow with the search).
        """
        return {
            "strategy": type(self).__name__,
            "format": STATE_FORMAT,
            "config": self.config(),
            "rng": rng_to_json(self._rng),
            # (shallow copies: cheap, and the items are never changed once appended)
            "candidate_lists": list(self._table.candidate_lists),
            "traces": list(self._table.traces),
            "log": list(self._log),
            "num_proposed": self._num_proposed,
            "elapsed": self._elapsed(),
            "algorithm": self._state(),
            "append_only": ["candidate_lists", "traces", "log"],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict` output; the search continues exactly where it was."""
        name = type(self).__name__
        if state.get("strategy") != name:
            raise ValueError(f"{name}.load_state_dict: the state was saved by "
                             f"{state.get('strategy')!r}; restore it into that strategy")
        if state["config"] != self.config():
            raise ValueError(f"{name}.load_state_dict: the state was saved with "
                             f"{state['config']} but this strategy has {self.config()}; "
                             f"construct it with the saved settings")
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"{name}.load_state_dict: the state has format "
                             f"{state.get('format', 1)}, this retiarii reads {STATE_FORMAT}; "
                             f"finish that search with the retiarii that started it")
        rng_from_json(self._rng, state["rng"])
        self._table = TraceTable(state["candidate_lists"], state["traces"])
        self._records, self._record_ids, self._told, self._log = {}, {}, [], []
        records: list[_Record] = []
        keys: list[str] = []

        def new(sample: dict, trace, proposed) -> None:
            key = sample_key(sample)
            self._new_record(key, _Record(dict(sample), trace, proposed=proposed))
            records.append(self._records[key])
            keys.append(key)

        def ask(index: int) -> None:
            records[index].pending += 1

        def tell(index: int, value, violation: float = 0.0) -> None:
            record = records[index]
            if record.pending > 0:  # as tell() did: a pending sample, else a foreign one
                record.pending -= 1
            record.values.append(value)
            self._told.append((keys[index], value))

        def trace(index: int, trace) -> None:
            records[index].trace = trace

        replay_log(state["log"], {"new": new, "ask": ask, "tell": tell, "trace": trace}, name)
        self._log = [list(event) for event in state["log"]]
        self._num_proposed = state["num_proposed"]
        self._elapsed_before = state["elapsed"]
        self._started_at = None
        self._checked = self._size = None
        self._load_state(state["algorithm"])

    # -- what subclasses implement ------------------------------------------------------------

    @abc.abstractmethod
    def _propose(self, space: Any) -> Draw:
        """The next candidate sample; the base class drops it if it repeats a known one."""

    def _on_tell(self, key: str, score: float | None) -> None:
        """Learns from a result; ``score`` is higher-is-better whatever ``mode`` is."""

    def _state(self) -> dict:
        return {}

    def _load_state(self, state: dict) -> None:
        pass

    # -- helpers for subclasses ---------------------------------------------------------------

    def _score(self, value: float | list[float], violation: float = 0.0) -> float | Scored:
        """Higher-is-better for one metric; with several objectives a :class:`Scored`: the
        point to minimize and its violation."""
        if self.objectives is not None:
            return Scored(tuple(-m.sign * v for m, v in zip(self.objectives, value)),
                          float(violation))
        return value * self.mode.sign

    def _random_draw(self, space: Any) -> Draw:
        return draw(space, RandomSampler(self._rng))

    def _trace(self, key: str, space: Any | None = None) -> list[tuple[str, list]] | None:
        """The ``(label, candidates)`` of a known sample; replays it through ``space`` when it
        was not recorded (a foreign or enumerated sample) and a space is given."""
        record = self._records[key]
        if record.trace is None and space is not None:
            record.trace = self._table.intern(draw(space, ReplaySampler(record.sample)).trace)
            self._log.append(["trace", self._record_ids[key], record.trace])
        if record.trace is None:
            return None
        return self._table.expand(record.trace)

    def _observations(self) -> Iterable[tuple[dict, float]]:
        """Told samples with their scores (higher is better), failed ones left out."""
        for key, value in self._told:
            if value is not None:
                yield self._records[key].sample, self._score(value)

    # -- internals ----------------------------------------------------------------------------

    def _space_size(self, space: Any) -> float | int:
        """``space.size()``, asked once per space (counting may walk the space)."""
        if self._size is None or self._size[0] != id(space):
            size = getattr(space, "size", None)
            self._size = (id(space), size() if callable(size) else math.inf)
        return self._size[1]

    def _elapsed(self) -> float:
        running = 0.0 if self._started_at is None else self._clock() - self._started_at
        return self._elapsed_before + running

    def _check_budget(self) -> None:
        name = type(self).__name__
        if self.max_models is not None and self._num_proposed >= self.max_models:
            raise BudgetExhausted(f"{name}: max_models={self.max_models} samples proposed")
        if self.max_time is not None and self._elapsed() >= self.max_time:
            raise BudgetExhausted(f"{name}: max_time={self.max_time}s used "
                                  f"({self._elapsed():.1f}s since the first ask)")

    def _new_at_random(self, space: Any, tries: int) -> tuple[Draw, str]:
        """After ``tries`` repeated proposals: a random new sample, or SpaceExhausted."""
        for _ in range(100):
            proposal = self._random_draw(space)
            key = sample_key(proposal.sample)
            if key not in self._records:
                return proposal, key
        size = self._space_size(space)
        name = type(self).__name__
        if size == math.inf:
            raise SpaceExhausted(
                f"{name}: {tries} proposals and as many random draws all repeated known "
                f"samples of this unbounded space; pass dedup=False to allow repeats")
        # Random draws hit known samples only: the space is (nearly) used up, so look for the
        # few unseen models in its enumeration.
        unseen = [m.sample for m in space.enumerate() if sample_key(m.sample) not in
                  self._records]
        if not unseen:
            raise SpaceExhausted(f"{name}: all {size} models of the space were proposed")
        sample = dict(unseen[self._rng.randrange(len(unseen))])
        return draw(space, ReplaySampler(sample)), sample_key(sample)

    def _new_record(self, key: str, record: _Record) -> _Record:
        self._records[key] = record
        self._record_ids[key] = len(self._record_ids)
        self._log.append(["new", record.sample, record.trace, record.proposed])
        return record

    def _record(self, proposal: Draw, key: str) -> None:
        record = self._records.get(key)
        if record is None:
            record = self._new_record(key, _Record(dict(proposal.sample),
                                                   self._table.intern(proposal.trace)))
        elif record.trace is None:
            record.trace = self._table.intern(proposal.trace)
            self._log.append(["trace", self._record_ids[key], record.trace])
        record.pending += 1
        if proposal.parent is not None:
            self._parents[key] = proposal.parent
        self._num_proposed += 1
        self._log.append(["ask", self._record_ids[key]])
