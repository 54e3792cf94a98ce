"""benchmarks/nas_rows.py's floor verdict (issue #31 item 3) on hand-made rows."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import nas_rows  # noqa: E402


def row(name, seed, selected, random_acc):
    return {"row": name, "seed": seed, "selected_val_acc": selected, "random_val_acc": random_acc}


def test_the_floor_needs_every_selection_over_0_9_and_a_mean_above_random():
    rows = [row("a", 0, 0.95, 0.90), row("a", 1, 0.93, 0.96),   # mean 0.94 > 0.93: met
            row("tie", 0, 0.99, 0.99),                            # a tie does not beat
            row("low", 0, 0.99, 0.50), row("low", 1, 0.89, 0.50),  # one selection under 0.9
            row("csv", 0, "0.97", "0.96"), row("none", 0, None, 0.9)]  # read back / no result
    got = {r["row"]: r for r in nas_rows.summarize(rows)}
    assert set(got) == {"a", "tie", "low", "csv"}
    assert got["a"]["floor"] and abs(got["a"]["selected"] - 0.94) < 1e-12
    assert abs(got["a"]["random"] - 0.93) < 1e-12 and got["a"]["min_selected"] == 0.93
    assert not got["tie"]["floor"] and not got["low"]["floor"] and got["csv"]["floor"]


def test_random_only_rows_join_the_random_mean_and_the_gap_has_its_standard_error():
    rows = [row("a", 0, 0.95, 0.90), row("a", 1, 0.93, 0.96),
            row("a", 2, None, 0.98), row("a", 3, "", "0.92")]  # --random-only runs
    (got,) = nas_rows.summarize(rows)
    assert (got["seeds"], got["random_samples"]) == (2, 4)
    assert abs(got["random"] - 0.94) < 1e-12 and abs(got["gap"] - 0.0) < 1e-12
    assert not got["floor"]  # 0.94 does not beat 0.94
    # var(sel) = 2 * 0.01^2 / 1 = 0.0002; var(rnd) = (2 * 0.04^2 + 2 * 0.02^2) / 3 = 0.004 / 3
    assert abs(got["gap_se"] - (0.0002 / 2 + 0.004 / 3 / 4) ** 0.5) < 1e-12
    assert nas_rows.summarize([row("b", 0, 0.95, 0.90)])[0]["gap_se"] is None
    # efficientnet's runs: 353.67 images of 359 on both sides, the float32 metrics' means
    # 9.9e-9 apart: a tie, not a win
    sel, rnd = (0.9860724210739136, 0.9944289922714233, 0.9749303460121155), (
        0.9888579249382019, 0.9888579249382019, 0.9749303460121155, 0.9888579249382019,
        0.9888579249382019, 0.9805014133453369)
    tie = [row("e", i, sel[i] if i < 3 else None, r) for i, r in enumerate(rnd)]
    (got,) = nas_rows.summarize(tie)
    assert 0 < got["gap"] < 1e-7 and not got["floor"]
    assert nas_rows.sign_test(rows)["pairs"] == 2  # random-only rows pair with nothing


def test_the_image_rows_leave_out_the_sequence_rows_only():
    from retiarii import nas

    names = {r.name for r in nas.ROWS}
    assert set(nas_rows.SEQUENCE_ROWS) <= names
    assert len(names) - len(nas_rows.SEQUENCE_ROWS) == 24


def test_the_pooled_sign_test_counts_pairs_and_gives_the_exact_binomial_p():
    rows = [row("a", 0, 0.95, 0.90), row("a", 1, 0.93, 0.96), row("b", 0, 0.99, 0.99),
            row("c", 0, "0.97", "0.96"), row("d", 0, None, 0.9)]
    got = nas_rows.sign_test(rows)
    # 2 wins, 1 loss, 1 tie: P(X <= 1) for X ~ B(3, 1/2) is 4/8, doubled: 1
    assert got == {"pairs": 4, "wins": 2, "ties": 1, "losses": 1, "p": 1.0}
    # 9 wins of 10: 2 * (1 + 10) / 1024
    ten = [row("r", i, 0.99, 0.98) for i in range(9)] + [row("r", 9, 0.97, 0.98)]
    assert abs(nas_rows.sign_test(ten)["p"] - 22 / 1024) < 1e-15
    assert nas_rows.sign_test([row("t", 0, 0.9, 0.9)]) == {"pairs": 1, "wins": 0, "ties": 1,
                                                            "losses": 0, "p": 1.0}
