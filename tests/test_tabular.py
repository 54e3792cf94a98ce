"""The tabular benchmark (benchmarks/tabular.py, issue #15 item 4): the shipped table, its
replay, and every strategy against random search over it."""
from __future__ import annotations

import itertools
import math
import os
import re
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import tabular  # noqa: E402
from model_spaces.nasbench201 import (  # noqa: E402
    EDGE_LABELS, OP_NAMES, PUBLISHED_SIZE, TABLE_OPS, arch_string, full_sample, small,
)
from retiarii.sampler import RandomSampler  # noqa: E402


@pytest.fixture(scope="module")
def table():
    return tabular.load_table()


@pytest.fixture(scope="module")
def accuracy(table):
    return tabular.final_accuracy(table[0])


# ---- the shipped table ----------------------------------------------------------------------


def test_the_table_holds_every_model_of_the_subspace_once_with_complete_finite_epochs(table):
    rows, _ = table
    assert len(rows) >= 1000
    assert len(rows) == tabular.SPACE.size() == 4 ** 5
    assert len({r["arch"] for r in rows}) == len(rows)
    for row in rows:
        sample = {label: row[label] for label in EDGE_LABELS}
        assert all(sample[label] in TABLE_OPS[label] for label in EDGE_LABELS)  # the sub-space
        assert all(op in OP_NAMES for op in sample.values())  # so a model of the full space
        assert row["arch"] == arch_string(sample)
        for name in tabular.METRICS:
            values = [row[f"{name}_{e}"] for e in range(1, tabular.EPOCHS + 1)]
            assert all(math.isfinite(v) for v in values), (row["arch"], name, values)
        assert all(0.0 <= row[f"val_acc_{e}"] <= 1.0 for e in range(1, tabular.EPOCHS + 1))
        assert row["params"] > 0 and row["job_seconds"] > 0 and row["job_models"] >= 1
    assert sorted(r["seed"] for r in rows) == list(range(len(rows)))  # grid index = seed


def test_the_table_says_how_it_was_made(table):
    _, header = table
    text = "\n".join(header)
    assert re.search(r"commit [0-9a-f]{40}", text)
    for fact in ("command: python benchmarks/tabular.py make", "started: ", "machine: ",
                 f"epochs={tabular.EPOCHS}", "GridSearch", "LocalExecutor 2 workers"):
        assert fact in text, fact
    assert "INCOMPLETE" not in text


def test_a_row_is_what_the_space_builds(table):
    """The parameter count recorded is that of the model SPACE builds from the row's sample."""
    rows, _ = table
    for row in rows[::257]:
        sample = {label: row[label] for label in EDGE_LABELS if len(TABLE_OPS[label]) > 1}
        net = tabular.SPACE.build(sample)
        assert sum(p.numel() for p in net.parameters()) == row["params"]


def test_the_subspace_is_the_full_space_with_narrowed_edges():
    assert small().size() == PUBLISHED_SIZE
    assert small(ops=TABLE_OPS).size() == 1024
    with pytest.raises(ValueError, match="name every edge"):
        small(ops={"edge_01": ("none",)})
    with pytest.raises(ValueError, match="distinct names"):
        small(ops={**TABLE_OPS, "edge_01": ("conv_5x5",)})
    assert full_sample({"edge_01": "none"} | {k: "none" for k in ("edge_02", "edge_12",
                                                                   "edge_13", "edge_23")},
                       TABLE_OPS)["edge_03"] == "skip_connect"


# ---- the replay -----------------------------------------------------------------------------


def test_the_choice_view_asks_what_the_space_asks():
    """Strategies search ChoiceSpace in place of SPACE: same labels, candidates and contexts in
    the same order, so the same sampler gives the same sample, and the same enumeration."""
    class Recorder:
        def __init__(self, seed):
            self.inner, self.asked = RandomSampler(seed), []

        def choose(self, label, candidates, context):
            self.asked.append((label, list(candidates), dict(context)))
            return self.inner.choose(label, candidates, context)

    view = tabular.ChoiceSpace()
    for seed in range(8):
        a, b = Recorder(seed), Recorder(seed)
        assert view.sample(a).sample == tabular.SPACE.sample(b).sample
        assert a.asked == b.asked
    assert view.size() == tabular.SPACE.size()
    firsts = itertools.islice(tabular.SPACE.enumerate(), 6)
    assert [m.sample for m in itertools.islice(view.enumerate(), 6)] == [m.sample for m in firsts]


@pytest.mark.parametrize("name", list(tabular.STRATEGIES))
def test_the_replay_is_deterministic_per_seed(accuracy, name):
    budget = 25
    one = tabular.replay(name, 3, budget, accuracy)
    assert one == tabular.replay(name, 3, budget, accuracy)
    assert len(one) == budget and one == sorted(one)  # best so far never falls


def test_the_simulated_executor_replay_through_the_engine_equals_the_fast_replay(table,
                                                                                accuracy):
    """The engine's search (rt.Experiment on SPACE, SimulatedExecutor(table=...), one
    worker) proposes the same models as the fast ask/tell loop, so their curves are equal."""
    rows, _ = table
    for name, budget in (("random", 6), ("evolution", 24)):
        assert tabular.engine_replay(name, 1, budget, rows) == \
            tabular.replay(name, 1, budget, accuracy)


# ---- every strategy against random search ---------------------------------------------------

BUDGET, SEEDS = 50, 20


@pytest.fixture(scope="module")
def random_baseline(accuracy):
    return [tabular.replay("random", s, BUDGET, accuracy)[-1] for s in range(SEEDS)]


# The GBT surrogates (predictor, progressive) refit as they propose: 100 s and 15 s for 20 seeds
# on 2 busy cores, so they run with -m slow; `benchmarks/tabular.py compare` runs them all
# (benchmarks/README.md has the figures).
CHEAP = ["evolution", "rl", "tpe"]
COSTLY = ["predictor", "progressive"]


@pytest.mark.parametrize("name", CHEAP + [pytest.param(n, marks=pytest.mark.slow)
                                          for n in COSTLY])
def test_beats_random_search_on_the_table_over_20_seeds(accuracy, random_baseline, name):
    ends = [tabular.replay(name, s, BUDGET, accuracy)[-1] for s in range(SEEDS)]
    assert statistics.mean(ends) > statistics.mean(random_baseline), \
        (name, statistics.mean(ends), statistics.mean(random_baseline))


def test_docstring_examples_run():
    import doctest

    result = doctest.testmod(tabular, raise_on_error=True)
    assert result.attempted > 0 and result.failed == 0
