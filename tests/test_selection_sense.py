"""A one-shot selection that makes sense: ENAS selects the best path it evaluated (judged
alike at the end) and `status` lists each architecture once with how often it was evaluated;
a selection no better than chance, or one of a tie, is said in the run's output and `status`."""
from __future__ import annotations

import json

import pytest
import torch

from one_shot_task import LinearTask, make_space, run
from retiarii.cli import main
from retiarii.cli_one_shot import print_result
from retiarii.cli_common import format_table as table
from retiarii.engine.storage.selection_notes import selection_warnings
from retiarii.engine.storage.segments_table import SegmentTable
from retiarii.engine.storage.store import Store
from retiarii.engine.trainers.trainer import ClassifierTrainer
from retiarii.sampler import sample_key
from retiarii.strategies import ENAS

CHANCE = {"metric": "val_acc", "value": 0.1, "n": 360, "how": "always one class of 10"}


def _store(path, models: list[tuple[dict, float]], selected: dict, chance=CHANCE,
           strategy="retiarii.strategies.one_shot.enas:ENAS") -> str:
    """A finished one-shot search by hand: one segment evaluating ``models`` in order."""
    config = {"strategy": {"class": strategy, "config": {}, "one_shot": True, "segments": 1},
              "metric": "val_acc", "mode": "max", "chance": chance}
    with Store(str(path)) as store:
        store.add_experiment(config, seed=0)
        table = SegmentTable(store)
        table.commit(1, "e1-one-shot/step-000001", {}, selected,
                     [{"sample": s, "metrics": {"val_acc": v}} for s, v in models],
                     metric="val_acc")
        value = [v for s, v in models if s == selected][-1]
        table.record_result(selected, None, None, value)
    return str(path)


def test_status_lists_a_path_drawn_ten_times_once_with_its_count(tmp_path, capsys):
    a, b = {"op": "linear"}, {"op": "skip"}
    models = [(a, 0.5 + i / 100) for i in range(10)] + [(b, 0.52)]
    db = _store(tmp_path / "r.db", models, selected=a)
    with Store(db) as store:
        store.use_experiment(1)
        best = SegmentTable(store).best("max", None)
    # each once, judged on its latest value (a: 0.59 at its 10th evaluation)
    assert [(x["sample"], x["value"], x["count"]) for x in best] == [(a, 0.59, 10), (b, 0.52, 1)]
    assert main(["status", db]) == 0
    out = capsys.readouterr().out
    assert out.count('{"op": "linear"}') == 2  # one table row, and the selected line
    assert "10x" in out and "1 *" in out  # its count; the selected one is marked


def test_enas_selects_the_best_path_it_evaluated_judged_alike(tmp_path):
    space, trainer = make_space(), LinearTask()
    s = ENAS(segments=2, controller_steps=8, seed=1)
    s.setup(space, trainer, {}, torch.device("cpu"))
    results = run(s, space, trainer)
    steps = [m for r in results for m in r.models if "controller_step" in m.metrics]
    chosen = [m for m in results[-1].models if m.metrics.get("select")]
    # every path the controller steps evaluated is judged again at the end, once each
    assert {sample_key(m.sample) for m in chosen} >= {sample_key(m.sample) for m in steps}
    assert len(chosen) == len({sample_key(m.sample) for m in chosen})
    best = max(chosen, key=lambda m: m.metrics["val_acc"])
    assert s.selected() == best.sample
    # recorded as the engine records them, the selected path heads the status listing
    models = [(m.sample, m.metrics["val_acc"]) for r in results for m in r.models]
    db = _store(tmp_path / "enas.db", models, s.selected())
    with Store(db) as store:
        store.use_experiment(1)
        assert SegmentTable(store).summary(2)["best"][0]["sample"] == s.selected()


def test_enas_resumed_after_the_selection_change_keeps_what_it_saw():
    space, trainer = make_space(), LinearTask()
    s = ENAS(segments=2, controller_steps=4, seed=0)
    s.setup(space, trainer, {}, torch.device("cpu"))
    run(s, space, trainer, range(1))
    state = s.state_dict()
    old = {k: v for k, v in state.items() if k != "seen"}  # a unit from before "seen"
    again = ENAS(segments=2, controller_steps=4, seed=0)
    again.setup(space, trainer, {}, torch.device("cpu"))
    again.load_state_dict(old)
    assert again._seen == {}
    again.load_state_dict(state)
    assert again._seen == s._seen and s._seen


def test_once_for_all_like_tie_at_chance_is_said():
    best = [{"sample": {"k": i}, "value": 0.0919} for i in range(24)]
    warnings = selection_warnings(best, 0.0919, CHANCE, "val_acc", "max")
    assert len(warnings) == 2
    assert warnings[0].startswith("not better than chance") and "0.0919" in warnings[0]
    assert warnings[1].startswith("a tie: 24 of the 24 architectures")


@pytest.mark.parametrize("values, selected, expected", [
    ([0.95, 0.90, 0.50], 0.95, []),  # clearly better than chance, no tie
    ([0.95, 0.95, 0.50], 0.95, ["a tie: 2 of the 3"]),
    ([0.95, 0.95, 0.50], 0.50, []),  # DARTS' alphas picked another: no tie
    ([0.12, 0.11], 0.12, ["not better than chance"]),  # within 2 standard errors of 0.1
    ([0.16, 0.11], 0.16, []),  # 0.16 > 0.1 + 2 * sqrt(0.09 / 360) = 0.1316
])
def test_selection_warnings_by_hand(values, selected, expected):
    best = [{"sample": {"i": i}, "value": v} for i, v in enumerate(values)]
    got = selection_warnings(best, selected, CHANCE, "val_acc", "max")
    assert [w[:len(e)] for w, e in zip(got, expected)] == expected and len(got) == len(expected)


def test_without_a_known_chance_only_ties_are_judged():
    best = [{"sample": {"i": 0}, "value": 0.05}, {"sample": {"i": 1}, "value": 0.01}]
    assert selection_warnings(best, 0.05, None, "val_acc", "max") == []
    assert selection_warnings(best, 0.05, {**CHANCE, "metric": "top5"}, "val_acc", "max") == []


def test_status_and_the_run_output_warn(tmp_path, capsys):
    models = [({"k": i}, 0.0919) for i in range(24)]
    db = _store(tmp_path / "ofa.db", models, {"k": 0},
                strategy="retiarii.strategies.one_shot.spos:SPOS")
    assert main(["status", db]) == 0
    out = capsys.readouterr().out
    assert "warning: the selection is not better than chance" in out
    assert "warning: the selection is a tie: 24 of the 24" in out
    assert main(["status", db, "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["one_shot"]["warnings"]) == 2
    with Store(db) as store:
        store.use_experiment(1)
        summary = {"one_shot": SegmentTable(store).summary(1)}
    print_result(summary, table)  # what `retiarii run` prints at the end
    assert "warning: the selection is not better than chance" in capsys.readouterr().out


def test_the_digits_trainer_knows_chance_and_records_it():
    chance = ClassifierTrainer().chance_level("val_acc")
    y = ClassifierTrainer().val_dataloader({})[0][1]
    assert chance["n"] == len(y) == 359
    assert chance["value"] == pytest.approx(float(torch.bincount(y).max()) / len(y))
    assert 0.1 <= chance["value"] < 0.15 and "10 classes" in chance["how"]
    assert ClassifierTrainer().chance_level("val_loss") is None


class _SameEither(torch.nn.Module):
    """Two choices that compute the same thing: any selection is a tie."""

    def __init__(self):
        super().__init__()
        import retiarii as rt
        self.fc = torch.nn.Linear(64, 10)
        self.act = rt.nn.LayerChoice({"a": torch.nn.Identity(), "b": torch.nn.Identity()},
                                     label="act")

    def forward(self, x):
        return self.act(self.fc(x.flatten(1)))


def _tie_space():
    import retiarii as rt
    return rt.ModelSpace(_SameEither(), example_input=torch.zeros(2, 1, 8, 8))


TIE_SPACE = _tie_space()


def test_a_python_user_is_warned_of_a_tied_selection(tmp_path):
    import retiarii as rt
    from engine_helpers import InProcessExecutor
    from retiarii.engine.driver.one_shot_host import SelectionWarning

    spos = rt.strategies.SPOS(train_segments=1, search_population=2, search_generations=1,
                              seed=1)
    exp = rt.Experiment(TIE_SPACE, spos, rt.Trainer(dataset="digits", epochs=1, batch_size=256),
                        store=str(tmp_path / "tie.db"), seed=0, executor=InProcessExecutor())
    with pytest.warns(SelectionWarning, match="tie"):
        summary = exp.run()
    assert any("tie" in w for w in summary["one_shot"]["warnings"])
