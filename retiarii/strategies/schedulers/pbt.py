"""Population-based training as a black-box service (initiator-based evolution, budget mode,
trial dependency DAG, training replay, checkpoint garbage collection)."""
from __future__ import annotations

import base64
import enum
import math
import random
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ...enums import Mode
from .base import (
    Decision, Scheduler, Spawn, check_state, from_json_float, json_float, metric_value,
    replay_log,
)

# ---- hyper-parameter kinds -------------------------------------------------------------------


@dataclass(frozen=True)
class Continuous:
    """A float in ``[low, high]``; sampled uniformly (log-uniformly if ``log``); mutated by a
    factor 0.8 or 1.2 drawn with equal odds, then clipped."""

    low: float
    high: float
    log: bool = False
    mutable: bool = True

    def sample(self, rng: random.Random) -> float:
        if self.log:
            return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return rng.uniform(self.low, self.high)

    def mutate(self, value: float, rng: random.Random) -> float:
        return min(self.high, max(self.low, value * rng.choice((0.8, 1.2))))


@dataclass(frozen=True)
class Integer:
    """An int in ``[low, high]``; mutated to ``round(x * m)``, ``m`` in {0.8, 1.2}, moving by one
    in the direction of ``m`` when rounding would leave it unchanged, then clipped."""

    low: int
    high: int
    mutable: bool = True

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def mutate(self, value: int, rng: random.Random) -> int:
        m = rng.choice((0.8, 1.2))
        new = int(round(value * m))
        if new == value:
            new = value + (1 if m > 1 else -1)
        return min(self.high, max(self.low, new))


@dataclass(frozen=True)
class Discrete:
    """One of an ordered list of numbers; mutated to the next lower or next higher element
    (equal odds; the only neighbour at either end)."""

    values: tuple
    mutable: bool = True

    def sample(self, rng: random.Random) -> Any:
        return rng.choice(list(self.values))

    def mutate(self, value: Any, rng: random.Random) -> Any:
        ordered = sorted(self.values)
        i = min(range(len(ordered)), key=lambda j: abs(ordered[j] - value))
        neighbours = [ordered[j] for j in (i - 1, i + 1) if 0 <= j < len(ordered)]
        return rng.choice(neighbours) if neighbours else value


@dataclass(frozen=True)
class Categorical:
    """One of a set of choices; mutation resamples uniformly (it may keep the same value)."""

    values: tuple
    mutable: bool = True

    def sample(self, rng: random.Random) -> Any:
        return rng.choice(list(self.values))

    def mutate(self, value: Any, rng: random.Random) -> Any:
        return rng.choice(list(self.values))


_KINDS = (Continuous, Integer, Discrete, Categorical)


def _rng_state(rng: random.Random) -> list:
    """``[version, base64 of the state words (uint32, little-endian), gauss]``."""
    version, internal, gauss = rng.getstate()
    return [version, base64.b64encode(struct.pack(f"<{len(internal)}I", *internal)).decode(),
            gauss]


def _set_rng_state(rng: random.Random, state: list) -> None:
    version, words, gauss = state
    data = base64.b64decode(words)
    rng.setstate((version, struct.unpack(f"<{len(data) // 4}I", data), gauss))


def _fitness_key(fitness: list | None) -> tuple:
    return tuple(-math.inf if f is None or math.isnan(f) else f for f in (fitness or [math.nan]))


class _Status(enum.StrEnum):
    """Where a member of the population stands (its record's ``"status"``)."""

    PENDING = "pending"  # training towards its stop step
    DONE = "done"  # reached it: has a fitness, may reproduce
    FAILED = "failed"  # failed for good: not counted in its generation


def _state_name(state: Any) -> str:
    return str(getattr(state, "name", state)).upper()


class PBT(Scheduler):
    """Population-based training, run as the black-box service of the seed paper.

    Every trial trains ``steps_per_trial`` steps, warm-started from its parent's checkpoint,
    and then stops (STOP at ``start + steps_per_trial``); its fitness is its last result's
    ``metric`` (a list of metrics compares lexicographically; negated for ``"min"``; NaN or
    missing is worst). Trials are created by :meth:`next_spawn`:

    * generation 0 gets ``population_size`` trials with sampled hyper-parameters (trials added
      by the user through ``on_trial_add`` count as generation 0);
    * afterwards the *initiator* is the oldest completed trial that has not yet reproduced; it
      meets one opponent drawn uniformly among the completed trials of the past
      ``opponent_generations`` generations (its own and earlier; itself excluded) in a binary
      tournament; the winner (the initiator on a tie, or when no opponent exists) is the
      parent; the child gets the parent's mutated hyper-parameters (see the parameter kinds),
      generation ``initiator + 1`` and the parent's final checkpoint (pinned at creation);
    * in ``budget_mode`` (population larger than the number of workers) an initiator reproduces
      only once its generation holds ``population_size`` trials, so generations stay whole;
    * no child is made beyond ``max_generations``.

    A trial that fails for good is replaced: its initiator reproduces again (generation 0:
    a fresh sample). :meth:`state_dict` holds the random state at construction and a log of
    what changed the population since (spawns, added, finished and failed trials), from which
    :meth:`load_state_dict` rebuilds the dependency DAG, the pins and the random state;
    :meth:`lineage` gives the chain to replay a trial from scratch and
    :meth:`deletable_checkpoints` the checkpoints garbage collection may remove.

    Example:
        >>> pbt = PBT("acc", "max", {"lr": Continuous(1e-4, 1e-1, log=True)},
        ...           population_size=2, steps_per_trial=2, max_generations=2, seed=0)
        >>> a, b = pbt.next_spawn(), pbt.next_spawn()
        >>> pbt.next_spawn() is None            # generation 0 is full and nobody has finished
        True
        >>> pbt.on_trial_result(a.trial_id, {"training_iteration": 2, "acc": 0.9}).name
        'STOP'
        >>> child = pbt.next_spawn()
        >>> (child.parent, child.parent_step, child.initiator) == (a.trial_id, 2, a.trial_id)
        True

    Args:
        metric: result key (or list of keys, by priority) of the fitness.
        mode: ``"min"`` or ``"max"``.
        space: hyper-parameter name -> :class:`Continuous`, :class:`Integer`,
            :class:`Discrete`, :class:`Categorical`, or a constant.
        population_size: trials per generation.
        steps_per_trial: steps each trial trains.
        max_generations: generations to run (None: until the runner's budget ends).
        opponent_generations: ``k`` of the paper (2).
        budget_mode: keep generations whole when workers are fewer than the population.
        time_attr: the result key holding the (global) step.
        seed: seeds sampling, tournaments and mutation.
        id_prefix: prefix of the trial ids it creates.
    """

    spawns_trials = True
    checkpoints_shared = True

    def __init__(self, metric: str | list[str], mode: str = "max",
                 space: Mapping[str, Any] | None = None, population_size: int = 8,
                 steps_per_trial: int = 1, max_generations: int | None = None,
                 opponent_generations: int = 2, budget_mode: bool = False,
                 time_attr: str = "training_iteration", seed: int | None = None,
                 id_prefix: str = "pbt"):
        mode = Mode.parse(mode, type(self).__name__)
        self.sign = mode.sign
        self.metrics = [metric] if isinstance(metric, str) else list(metric)
        if not self.metrics:
            raise ValueError("PBT needs at least one metric")
        if population_size < 1 or steps_per_trial < 1 or opponent_generations < 1:
            raise ValueError("population_size, steps_per_trial and opponent_generations must be "
                             f">= 1, got {population_size}, {steps_per_trial}, "
                             f"{opponent_generations}")
        if max_generations is not None and max_generations < 1:
            raise ValueError(f"max_generations must be >= 1 or None, got {max_generations}")
        self.space = dict(space or {})
        self.mode, self.time_attr, self.id_prefix = mode, time_attr, id_prefix
        self.population_size, self.steps_per_trial = population_size, steps_per_trial
        self.max_generations, self.k = max_generations, opponent_generations
        self.budget_mode = budget_mode
        self._rng = random.Random(seed)
        self._rng_start = _rng_state(self._rng)
        self._trials: dict[str, dict] = {}  # the population and its DAG, in creation order
        self._pins: dict[str, list] = {}  # child -> [donor trial, donor step]
        self._counter = 0
        # The inputs that changed the state above, in order: ["spawn"] (next_spawn made a
        # trial), ["add", trial, config], ["finish", trial, time, fitness], ["error", trial],
        # ["sample"] (sample_config called from outside). Replayed from the random state at
        # construction they rebuild the state exactly; state_dict saves this log, which only
        # grows at its end (a store writes just what is new after every decision).
        self._log: list[list] = []

    # ---- population bookkeeping ---------------------------------------------------------

    def _new_trial(self, trial_id: str, gen: int, config: dict, parent: str | None = None,
                   parent_step: int = 0, initiator: str | None = None) -> dict:
        rec = {"gen": gen, "config": config, "parent": parent, "parent_step": parent_step,
               "initiator": initiator, "start": parent_step,
               "stop": parent_step + self.steps_per_trial, "end": None, "fitness": None,
               "status": _Status.PENDING, "initiated": False}
        self._trials[trial_id] = rec
        if parent is not None:
            self._pins[trial_id] = [parent, parent_step]
        return rec

    def _next_id(self) -> str:
        while True:
            self._counter += 1
            trial_id = f"{self.id_prefix}-{self._counter:04d}"
            if trial_id not in self._trials:
                return trial_id

    def _gen_size(self, gen: int) -> int:
        return sum(1 for r in self._trials.values()
                   if r["gen"] == gen and r["status"] is not _Status.FAILED)

    def _better(self, a: str, b: str) -> bool:
        """Strictly better fitness (lexicographic)."""
        return _fitness_key(self._trials[a]["fitness"]) > _fitness_key(self._trials[b]["fitness"])

    def _can_reproduce(self, rec: dict) -> bool:
        if rec["status"] is not _Status.DONE or rec["initiated"]:
            return False
        if self.max_generations is not None and rec["gen"] + 1 >= self.max_generations:
            return False
        return not self.budget_mode or self._gen_size(rec["gen"]) >= self.population_size

    def _mutate(self, config: dict) -> dict:
        child = dict(config)
        for name, kind in self.space.items():
            if isinstance(kind, _KINDS) and kind.mutable and name in child:
                child[name] = kind.mutate(child[name], self._rng)
        return child

    def _finish(self, trial_id: str, result: dict, time: float) -> None:
        self._finished(trial_id, time, [self.sign * metric_value(result, m) for m in self.metrics])

    def _finished(self, trial_id: str, time: float, fitness: list[float]) -> None:
        self._log.append(["finish", trial_id, time, [json_float(f) for f in fitness]])
        rec = self._trials[trial_id]
        rec["status"], rec["end"] = _Status.DONE, int(time) if float(time).is_integer() else time
        rec["fitness"] = fitness

    # ---- the scheduler interface --------------------------------------------------------

    def sample_config(self) -> dict:
        """Hyper-parameters drawn from ``space`` (constants copied)."""
        self._log.append(["sample"])  # it draws from the scheduler's random state
        return self._sample_config()

    def _sample_config(self) -> dict:
        return {name: kind.sample(self._rng) if isinstance(kind, _KINDS) else kind
                for name, kind in self.space.items()}

    def next_spawn(self) -> Spawn | None:
        if self._gen_size(0) < self.population_size:
            self._log.append(["spawn"])
            trial_id = self._next_id()
            rec = self._new_trial(trial_id, 0, self._sample_config())
            return Spawn(parent=None, config=rec["config"], trial_id=trial_id)
        initiator = next((t for t, r in self._trials.items() if self._can_reproduce(r)), None)
        if initiator is None:
            return None
        self._log.append(["spawn"])
        irec = self._trials[initiator]
        low = irec["gen"] - self.k + 1
        pool = [t for t, r in self._trials.items() if t != initiator
                and r["status"] is _Status.DONE and low <= r["gen"] <= irec["gen"]]
        winner = initiator
        if pool:
            opponent = self._rng.choice(pool)
            if self._better(opponent, initiator):
                winner = opponent
        wrec = self._trials[winner]
        irec["initiated"] = True
        trial_id = self._next_id()
        self._new_trial(trial_id, irec["gen"] + 1, self._mutate(wrec["config"]), parent=winner,
                        parent_step=wrec["end"], initiator=initiator)
        return Spawn(parent=winner, config=self._trials[trial_id]["config"], trial_id=trial_id,
                     parent_step=wrec["end"], initiator=initiator)

    def on_trial_add(self, trial_id: str, config: dict) -> None:
        if trial_id not in self._trials:  # a user-supplied starting trial: generation 0
            self._log.append(["add", trial_id, dict(config)])
            self._new_trial(trial_id, 0, dict(config))

    def on_trial_result(self, trial_id: str, result: dict) -> Decision:
        if self.time_attr not in result:
            raise ValueError(f"PBT needs {self.time_attr!r} in every result, got keys "
                             f"{sorted(result)}")
        if trial_id not in self._trials:
            self.on_trial_add(trial_id, {})
        rec, time = self._trials[trial_id], result[self.time_attr]
        if rec["status"] is not _Status.PENDING:
            return Decision.STOP
        if time >= rec["stop"]:
            self._finish(trial_id, result, time)
            return Decision.STOP
        return Decision.CONTINUE

    def on_trial_complete(self, trial_id: str, result: dict) -> None:
        rec = self._trials.get(trial_id)
        if rec is not None and rec["status"] is _Status.PENDING:
            self._finish(trial_id, result, result.get(self.time_attr, rec["start"]))

    def on_trial_error(self, trial_id: str) -> None:
        rec = self._trials.get(trial_id)
        if rec is None:
            return
        self._log.append(["error", trial_id])
        rec["status"] = _Status.FAILED
        self._pins.pop(trial_id, None)
        if rec["initiator"] is not None:  # the initiator reproduces again
            self._trials[rec["initiator"]]["initiated"] = False

    # ---- DAG: lineage, replay, garbage collection ---------------------------------------

    def best_trial(self) -> str | None:
        """The completed trial with the best fitness (the oldest on a tie)."""
        done = [t for t, r in self._trials.items() if r["status"] is _Status.DONE]
        return max(done, key=lambda t: _fitness_key(self._trials[t]["fitness"])) if done else None

    def lineage(self, trial_id: str) -> list[dict]:
        """The chain to retrain ``trial_id`` from scratch, root first.

        Each entry: ``trial_id, parent, parent_step, initiator, config, start_step, stop_step,
        generation`` (``initiator``: the trial whose reproduction made it, which met an
        opponent; ``parent`` is the tournament's winner); replaying the entries in order
        (each warm-started from the previous one's checkpoint at ``parent_step``) reproduces
        the trial's hyper-parameter schedule.
        """
        if trial_id not in self._trials:
            raise KeyError(f"{trial_id!r} is not a trial of this PBT run")
        chain, cur = [], trial_id
        while cur is not None:
            r = self._trials[cur]
            chain.append({"trial_id": cur, "parent": r["parent"], "parent_step": r["parent_step"],
                          "initiator": r["initiator"], "config": dict(r["config"]), "start_step": r["start"],
                          "stop_step": r["end"] if r["end"] is not None else r["stop"],
                          "generation": r["gen"]})
            cur = r["parent"]
        return chain[::-1]

    def replay_plan(self, trial_ids: Iterable[str]) -> list[dict]:
        """The union of several lineages in a topological (creation) order: subset replay."""
        order = {t: i for i, t in enumerate(self._trials)}
        entries = {e["trial_id"]: e for t in trial_ids for e in self.lineage(t)}
        return sorted(entries.values(), key=lambda e: order[e["trial_id"]])

    def pinned(self) -> dict[str, tuple[str, int]]:
        """child -> (donor trial, donor step) of the checkpoints children start from."""
        return {c: (p, s) for c, (p, s) in self._pins.items()}

    def deletable_checkpoints(self, checkpoints: Iterable[tuple[str, int, str]],
                              states: Mapping[str, Any],
                              keep_lineage_of: Iterable[str] | None = None) -> set[str]:
        """Paths of checkpoints garbage collection may delete.

        Kept: the latest own checkpoint of every PENDING, RUNNING, PAUSED or ERRORED trial (or
        its pinned donor checkpoint while it has none); the final checkpoint of every completed
        trial a future tournament could still pick as a parent; the pinned donors along the
        lineage of ``keep_lineage_of`` (default: the best trial) and those trials' final
        checkpoints; the latest checkpoint of any trial this PBT does not know. Everything
        else (intermediate checkpoints, finals no one can pick) may go.

        Args:
            checkpoints: ``(trial_id, step, path)`` of every checkpoint that exists.
            states: trial id -> state (a ``TrialState`` or its name).
            keep_lineage_of: trials whose lineage must stay replayable from checkpoints.
        """
        checkpoints = list(checkpoints)
        at = {(t, s): p for t, s, p in checkpoints}
        latest: dict[str, tuple[int, str]] = {}
        for t, s, p in checkpoints:
            if t not in latest or s > latest[t][0]:
                latest[t] = (s, p)
        keep: set[str] = set()

        def keep_at(trial_id: str, step: Any) -> None:
            if (trial_id, step) in at:
                keep.add(at[(trial_id, step)])

        live = {"PENDING", "RUNNING", "PAUSED", "ERRORED"}
        for trial_id, state in states.items():
            if trial_id not in self._trials:
                if trial_id in latest:
                    keep.add(latest[trial_id][1])
            elif _state_name(state) in live:
                if trial_id in latest:
                    keep.add(latest[trial_id][1])
                elif trial_id in self._pins:
                    keep_at(*self._pins[trial_id])
        future = [r["gen"] for r in self._trials.values()
                  if r["status"] is _Status.PENDING
                  or (r["status"] is _Status.DONE and not r["initiated"])]
        if future:
            low = min(future) - self.k + 1
            for trial_id, r in self._trials.items():
                if r["status"] is _Status.DONE and r["gen"] >= low:
                    keep_at(trial_id, r["end"])
        if keep_lineage_of is None:
            best = self.best_trial()
            keep_lineage_of = [] if best is None else [best]
        for final in keep_lineage_of:
            keep_at(final, self._trials[final]["end"])
            for entry in self.lineage(final):
                if entry["parent"] is not None:
                    keep_at(entry["parent"], entry["parent_step"])
        return {p for _, _, p in checkpoints if p not in keep}

    # ---- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """``{"kind", "rng_start", "log", "append_only": ["log"]}``: the random state at
        construction and the inputs that changed the state since (see ``__init__``), replayed
        by :meth:`load_state_dict`."""
        return {"kind": "PBT", "rng_start": self._rng_start, "log": list(self._log),
                "append_only": ["log"]}

    def load_state_dict(self, state: dict) -> None:
        check_state(state, "PBT")
        self._trials, self._pins, self._counter, self._log = {}, {}, 0, []
        self._rng_start = state["rng_start"]
        _set_rng_state(self._rng, self._rng_start)
        def spawn() -> None:
            if self.next_spawn() is None:
                raise ValueError("a saved PBT state does not replay (a spawn it logged did "
                                 "not happen again): build the PBT with the same arguments")

        replay_log(state["log"], {
            "spawn": spawn,
            "add": self.on_trial_add,
            "finish": lambda trial_id, time, fitness: self._finished(
                trial_id, time, [from_json_float(f) for f in fitness]),
            "error": self.on_trial_error,
            "sample": self.sample_config,
        }, "PBT")
