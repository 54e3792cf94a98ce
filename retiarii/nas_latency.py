"""The papers' cost terms `retiarii nas run` applies by default (``cost_term``): the latency
tables, lookups, targets and base latencies each row's strategy takes, all from the operator
table measured on this machine and kept in the run's store (so a resume rebuilds the very same
strategy)."""
from __future__ import annotations

import os
from typing import Any


def base_latency(presets: Any, preset: str, store: str) -> float:
    """The predicted latency (ms) of the base model (every choice at its first candidate) of
    ``getattr(presets, preset)`` (a row's ``nas.SPACES.<name>``) by the operator table kept
    in ``store``."""
    from .engine.driver.op_latency import OpLatencyTable
    from .engine.storage.store import Store

    space = getattr(presets, preset)
    with Store(store) as db:
        return OpLatencyTable(db).predict(
            space.instantiate(space.default_sample()).to_module(), space.example_input[:1])


def elastic_table(presets: Any, preset: str, store: str) -> dict:
    """Once-for-All's latency lookup of ``getattr(presets, preset)`` (see
    :func:`retiarii.strategies.one_shot.once_for_all.ofa_latency_table`) from the operator table kept
    in ``store``."""
    from .engine.driver.op_latency import OpLatencyTable
    from .engine.storage.store import Store
    from .strategies.one_shot.once_for_all import ofa_latency_table

    os.makedirs(os.path.dirname(os.path.abspath(store)), exist_ok=True)
    with Store(store) as db:
        return ofa_latency_table(getattr(presets, preset), OpLatencyTable(db))


# Rows whose paper adds a latency term from a lookup table to the architecture loss, and its
# weight: ProxylessNAS's expected latency, one ms of which weighs as a unit of cross-entropy
# (the small preset's candidates differ by 0.01-0.2 ms: the term moves the choice, it does
# not swamp the accuracy). The table is measured on this machine (engine/op_latency.py) and
# kept in the run's store, so that a resume rebuilds the very same strategy.
LATENCY_TERM = {"proxylessnas": 1.0}
# Rows whose loss adds lambda * log(R), R the predicted latency of the selected architecture
# (Single-Path NAS): the table plus the base model's latency (R's constant), and lambda
RUNTIME_TERM = {"single_path_nas": 1.0}
# Rows whose search ranks candidates by latency as a second objective (FairNAS's and
# SCARLET-NAS's NSGA-II): the same table, handed to the strategy as ``latency``
LATENCY_OBJECTIVE = ("fairnas", "scarlet_nas")


# Rows whose search bounds a sub-network's latency by the operator table (Once-for-All)
ELASTIC_LATENCY = ("once_for_all",)

# The other rows whose paper has a cost term, and what it is (nas.experiment applies it
# unless the options give one): FBNet's latency loss from a lookup table (GumbelDARTS's
# latency=, the paper's alpha 0.2 and beta 0.6); MnasNet's reward ACC x (LAT / target) ** w
# (w = -0.07, the paper's soft constraint) over the predicted latency, which a busy machine
# does not disturb as it does a timed pass (benchmarks/README.md, #30).
# ChamNet's genetic search keeps the lookup table's prediction under the target, the median
# predicted latency of random models as MnasNet's (the paper: a platform's latency budget);
# the Experiment checks the per-operator table's own sum too, before training
COST_TERMS = {"fbnet": "latency loss", "mnasnet": "reward", "chamnet": "latency constraint",
              "efficientnet": "FLOPs reward"}
# random models whose median predicted latency is MnasNet's target (the paper: 75 ms, a
# budget on its phone; here the middle of the space on this machine)
MNASNET_TARGET_MODELS = 16


def latency_lut(presets: Any, preset: str, store: str) -> dict:
    """The latency lookup table (:class:`~retiarii.cost_terms.LatencyLUT` as JSON) of
    ``getattr(presets, preset)`` (a row's ``nas.SPACES.<name>``) from the operator table kept in
    ``store``."""
    from .cost_terms import LatencyLUT
    from .engine.driver.op_latency import OpLatencyTable
    from .engine.storage.store import Store

    os.makedirs(os.path.dirname(os.path.abspath(store)), exist_ok=True)
    with Store(store) as db:
        return LatencyLUT.of(getattr(presets, preset),
                             OpLatencyTable(db)).to_json()


def latency_target(presets: Any, preset: str, store: str, models: int = MNASNET_TARGET_MODELS,
                   seed: int = 0) -> float:
    """The median predicted latency (ms, the operator table kept in ``store``) of ``models``
    random models of ``getattr(presets, preset)`` drawn with ``seed``."""
    from .cost_terms import median_predicted_latency
    from .engine.driver.op_latency import OpLatencyTable
    from .engine.storage.store import Store

    os.makedirs(os.path.dirname(os.path.abspath(store)), exist_ok=True)
    with Store(store) as db:
        return median_predicted_latency(getattr(presets, preset),
                                        OpLatencyTable(db), models, seed)


def _paper_term(name: str, presets: Any, preset: str, store: str, options: dict,
                kwargs: dict) -> dict:
    """The options (and Experiment arguments, in ``kwargs``) of row ``name``'s paper's cost
    term, unless the caller gave their own."""
    if name in LATENCY_TERM and "latency" not in options:  # ProxylessNAS's expected latency
        return {"latency": latency_table(presets, preset, store),
                "latency_weight": LATENCY_TERM[name], **options}
    if name == "fbnet" and "latency" not in options:
        return {"latency": latency_lut(presets, preset, store), **options}
    if name == "chamnet" and "constraints" not in options:
        target = latency_target(presets, preset, store)
        bound = [f"predicted_latency_ms <= {target:.6g}"]
        kwargs.setdefault("constraints", bound)
        return {"latency": latency_lut(presets, preset, store), "constraints": bound,
                **options}
    if name == "mnasnet" and "reward" not in options and "metric" not in kwargs:
        from .scalarization import MnasNetReward

        kwargs.update(metric=["val_acc", "predicted_latency_ms"], mode=["max", "min"])
        target = latency_target(presets, preset, store)
        return {"reward": MnasNetReward("val_acc", "predicted_latency_ms", target=target),
                **options}
    if name == "efficientnet" and "reward" not in options and "metric" not in kwargs:
        return {"reward": _flops_reward(presets, preset, kwargs), **options}
    return options


def _flops_reward(presets: Any, preset: str, kwargs: dict):
    """EfficientNet's phase-1 reward: MnasNet's ``ACC x (FLOPS / T) ** -0.07`` on FLOPs, ``T``
    the FLOPs of the space's default model (B0 as published; the paper: a 400M target)."""
    from torch.utils.flop_counter import FlopCounterMode

    from .scalarization import MnasNetReward

    space = getattr(presets, preset)
    counter = FlopCounterMode(display=False)
    with counter:
        space.instantiate(space.default_sample()).to_module().eval()(space.example_input[:1])
    kwargs.update(metric=["val_acc", "flops"], mode=["max", "min"])
    return MnasNetReward("val_acc", "flops", target=float(counter.get_total_flops()))


def latency_table(presets: Any, preset: str, store: str) -> dict:
    """``{label: {candidate: ms}}`` of ``getattr(presets, preset)``: each candidate's predicted
    latency over the base model's, from the operator table kept in ``store``."""
    from .engine.driver.op_latency import OpLatencyTable, choice_latencies
    from .engine.storage.store import Store

    os.makedirs(os.path.dirname(os.path.abspath(store)), exist_ok=True)
    with Store(store) as db:
        return choice_latencies(getattr(presets, preset), OpLatencyTable(db))


def cost_term(name: str, presets: Any, preset: str, store: str, options: dict,
              kwargs: dict) -> dict:
    """The strategy options (and Experiment arguments, added to ``kwargs``) of row ``name``'s
    paper cost term, unless ``options`` already give one (``presets``: ``nas.SPACES.<name>``)."""
    if "latency" in options:
        return options
    if name in RUNTIME_TERM:  # Single-Path NAS: lambda * log(R)
        return {"latency": latency_table(presets, preset, store),
                "base_latency": base_latency(presets, preset, store),
                "latency_weight": RUNTIME_TERM[name], **options}
    if name in ELASTIC_LATENCY:  # Once-for-All: the latency bound of its evolution
        return {"latency": elastic_table(presets, preset, store), **options}
    if name in LATENCY_OBJECTIVE:  # FairNAS, SCARLET-NAS: NSGA-II's second objective
        return {"latency": latency_table(presets, preset, store), **options}
    return _paper_term(name, presets, preset, store, options, kwargs)
