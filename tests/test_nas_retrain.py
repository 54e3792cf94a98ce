"""DARTS as its paper runs it (a mixed op with ``none`` on every edge, the top-k derivation,
architecture steps on their own split of the training data; the recurrent cell likewise),
and ``nas run``'s second phase: the selected architecture retrained from scratch, linked to
its search in the same store, resumable."""
from __future__ import annotations

import json

import pytest
import torch

from engine_helpers import InProcessExecutor
from retiarii import nas, nas_retrain
from retiarii.arch_split import ArchSplitTrainer
from retiarii.cli import main
from retiarii.engine.trainers import trainer as trainer_module
from retiarii.engine.jobs.job import TrialCheckpointed
from retiarii.engine.storage.store import Store
from retiarii.optim.derivation import DerivationError, EdgeDerivation


# ---- the derivation -------------------------------------------------------------------------
def test_edge_derivation_keeps_the_strongest_non_none_edges_hand_computed():
    keys = {label: ["none", "conv", "pool"] for label in ("a", "b", "c", "d")}
    rule = EdgeDerivation(nodes=(("n0", ("a", "b")), ("n1", ("a", "b", "c", "d"))), keep=2)
    probs = {"a": [0.9, 0.05, 0.05],  # none wins, best other op 0.05: the weakest edge
             "b": [0.1, 0.3, 0.6],  # pool 0.6
             "c": [0.2, 0.7, 0.1],  # conv 0.7
             "d": [0.4, 0.35, 0.25]}  # conv 0.35
    # n0 keeps both its edges (2 of 2); n1 keeps c (0.7) and b (0.6), drops d and a
    assert rule(probs, keys) == {"a": 0, "b": 2, "c": 1, "d": 0}
    assert EdgeDerivation(nodes=(("n1", ("a", "b", "c", "d")),), keep=1)(probs, keys) == \
        {"a": 0, "b": 0, "c": 1, "d": 0}
    with pytest.raises(DerivationError, match="'e' of node 'n'"):
        EdgeDerivation(nodes=(("n", ("a", "e")),))(probs, keys)
    with pytest.raises(DerivationError, match="must offer 'none'"):
        EdgeDerivation(nodes=(("n", ("a", "b")),))(probs, {"a": ["x", "y"], "b": ["x", "y"]})


def test_darts_space_has_a_mixed_op_with_none_per_edge_and_derives_top_2():
    from model_spaces import darts
    from retiarii.optim.relax import Relaxation

    space = nas.build_space("darts", "small")
    relax = Relaxation(space)
    edges = {f"{kind}/n{k}/e{i}" for kind in ("normal", "reduce") for k in range(4)
             for i in range(k + 2)}
    assert set(relax.labels) == edges  # one choice per edge i -> k, i < k + 2
    assert all(relax.keys[label] == list(darts.OP_NAMES) for label in edges)
    assert "none" in darts.OP_NAMES and len(darts.OP_NAMES) == 8
    # the edge node mixes all 8 candidates (a Zero among them)
    plan = next(p for p in relax.reading.nodes if p.name == "cells.0.e3_4")
    assert plan.labels == ("normal/n3/e4",) and len(plan.variants) == 8
    assert any("Zero" in relax.reading.ops[key].describe() for key, _ in plan.variants)
    # hand-set alphas: node 3 of the normal cell; e0 has none strongest but its best op
    # (skip_connect) is weak; e2's sep_conv_5x5 and e4's max_pool_3x3 win; node 0 keeps both
    op = {name: i for i, name in enumerate(darts.OP_NAMES)}
    with torch.no_grad():
        for label, hot in {"normal/n3/e0": {"none": 5.0, "skip_connect": 1.0},
                           "normal/n3/e1": {"avg_pool_3x3": 1.5},
                           "normal/n3/e2": {"sep_conv_5x5": 3.0},
                           "normal/n3/e3": {"none": 0.5, "dil_conv_3x3": 0.5},
                           "normal/n3/e4": {"max_pool_3x3": 2.0},
                           "normal/n0/e0": {"sep_conv_3x3": 1.0},
                           "normal/n0/e1": {"none": 9.0, "dil_conv_5x5": 0.2}}.items():
            for name, value in hot.items():
                relax.alpha(label)[op[name]] = value
    derived = relax.derive()
    assert darts.genotype(derived)["normal"][:2] == [("sep_conv_3x3", 0), ("dil_conv_5x5", 1)]
    node3 = {i: derived[f"normal/n3/e{i}"] for i in range(5)}
    assert node3 == {0: "none", 1: "none", 2: "sep_conv_5x5", 3: "none", 4: "max_pool_3x3"}
    # every node of the derived cells keeps exactly 2 non-none edges
    for kind, edges_of in darts.genotype(derived).items():
        assert len(edges_of) == 8
    net = relax.export(derived)
    assert net(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


# ---- the architecture split -------------------------------------------------------------------
def test_arch_split_is_disjoint_from_the_reported_validation_split():
    trainer = ArchSplitTrainer(dataset="digits", batch_size=100)
    weights, arch, val = (set(t.tolist()) for t in trainer.split_indices({}))
    assert not (weights & arch or weights & val or arch & val)
    assert len(weights | arch | val) == 1797 and abs(len(weights) - len(arch)) <= 1
    x, y = trainer_module.load_dataset("digits")
    # the loaders hand out exactly those examples
    for loader, part in ((trainer.train_dataloader({}, 3), weights),
                         (trainer.arch_dataloader({}, 3), arch), (trainer.val_dataloader({}), val)):
        got = torch.cat([bx for bx, _ in loader])
        assert torch.equal(got.flatten(1).sum(1).sort().values,
                           x[sorted(part)].flatten(1).sum(1).sort().values)
    with pytest.raises(ValueError, match="arch_fraction=1.0 leaves no training example"):
        ArchSplitTrainer(arch_fraction=1.0).arch_dataloader({}, 0)


def test_darts_architecture_steps_read_the_arch_split_only(few_digits):
    from retiarii.strategies import DARTS
    from retiarii.strategies.one_shot import SegmentContext

    seen = {"arch": [], "weight": []}

    class Spy(ArchSplitTrainer):
        def training_step(self, model, batch, hparams):
            seen[model.mode == "softmax" and strategy.relaxation.alphas[0].requires_grad
                 and phase[0]].append(batch[0])
            return super().training_step(model, batch, hparams)

    class Spied(DARTS):
        def arch_step(self, train_batch, valid_batch, segment):
            phase[0] = "arch"
            return super().arch_step(train_batch, valid_batch, segment)

        def weight_step(self, batch, segment):
            phase[0] = "weight"
            return super().weight_step(batch, segment)

    phase = ["weight"]
    trainer = Spy(dataset="digits", batch_size=8)
    strategy = Spied(epochs=1)
    strategy.setup(nas.build_space("darts_rnn", "small"), trainer, {}, torch.device("cpu"))
    strategy.run_segment(SegmentContext(0, trainer, {}, torch.device("cpu")))
    x, _ = trainer_module.load_dataset("digits")
    weights, arch, val = trainer.split_indices({})

    def rows(part):
        return {tuple(r.flatten().tolist()) for r in x[part]}

    arch_seen = {tuple(r.flatten().tolist()) for b in seen["arch"] for r in b}
    weight_seen = {tuple(r.flatten().tolist()) for b in seen["weight"] for r in b}
    assert arch_seen and arch_seen <= rows(arch) and not arch_seen & rows(val)
    assert weight_seen and weight_seen <= rows(weights)


# ---- DARTS' recurrent cell ------------------------------------------------------------------
def test_darts_rnn_mixes_every_predecessor_and_derives_the_strongest_hand_set():
    from model_spaces.recurrent_relax import DartsRNNRelaxation, PRIMITIVES

    space = nas.build_space("darts_rnn", "small")
    relax = DartsRNNRelaxation(space)
    assert len(relax.labels) == sum(range(1, 9))  # an edge j -> i for every j < i
    assert all(relax.keys[label] == ["none", "tanh", "relu", "sigmoid", "identity"]
               for label in relax.labels)
    x = torch.rand(4, 1, 8, 8)
    loss = relax(x).sum()
    loss.backward()
    assert all(a.grad is not None and a.grad[1:].abs().sum() > 0 for a in relax.alphas)
    op = {name: i for i, name in enumerate(PRIMITIVES)}
    with torch.no_grad():
        relax.alpha("darts/node3/e0")[op["none"]] = 4.0  # none wins but relu is weak
        relax.alpha("darts/node3/e0")[op["relu"]] = 0.5
        relax.alpha("darts/node3/e2")[op["sigmoid"]] = 1.0
        relax.alpha("darts/node1/e0")[op["identity"]] = 0.3
    sample = relax.derive()
    assert sample["darts/node3/input"] == 2 and sample["darts/node3/op"] == "sigmoid"
    assert sample["darts/node1/input"] == 0 and sample["darts/node1/op"] == "identity"
    assert sample["darts/node2/input"] == 0 and sample["darts/node2/op"] == "tanh"  # ties
    # the fixed supernet computes what the exported standalone model computes
    net = relax.export(sample).eval()
    relax.fix(sample).eval()
    assert torch.allclose(net(x), relax(x), atol=1e-6)
    assert net.state_dict().keys() == relax.weights.state_dict().keys()


def test_the_darts_rows_are_faithful_and_run_darts():
    for name in ("darts", "darts_rnn"):
        row = nas.get(name)
        assert row.status == "faithful" and row.runs_with == "DARTS"
        assert "first-order" in row.note and "Scale" in row.note
        assert name in nas.ARCH_SPLIT


# ---- search, then retrain -------------------------------------------------------------------
def _phases(db):
    with Store(db) as store:
        return [(e["id"], e["status"], e["config"].get("origin") or {})
                for e in store.experiments()]


def test_nas_run_searches_then_retrains_linked_in_one_store(tmp_path, few_digits, in_process,
                                                            capsys):
    db = str(tmp_path / "nb.db")
    assert main(["nas", "run", "nasbench201", "--max-models", "2", "--epochs", "1",
                 "--retrain-epochs", "2", "--store", db, "--workers", "1"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("nasbench201: search"))
    assert "2 models" in line and "retrained from scratch 2 epochs" in line
    assert "val_acc" in line
    (search, s_status, s_origin), (retrain, r_status, r_origin) = _phases(db)
    assert s_origin["nas"]["retrain_epochs"] == 2 and s_status == r_status == "done"
    link = r_origin["nas_retrain"]
    assert link["search_experiment"] == search and link["retrain_epochs"] == 2
    best_id, best_sample, _ = nas_retrain.selected_model(db, search)
    assert link["model"] == best_id and link["sample"] == best_sample
    with Store(db) as store:
        store.use_experiment(retrain)
        models = store.models()
        assert [m["sample"] for m in models] == [best_sample]  # the selection, retrained
        config = store.get_experiment()["config"]
    assert json.dumps(config["trainer"]).count('"sgd"') == 1  # the row's recipe
    assert main(["nas", "run", "nasbench201", "--retrain-epochs", "-1", "--store", db]) == 2


def test_the_retrain_phase_resumes_to_what_an_uninterrupted_one_gives(tmp_path, few_digits,
                                                                      in_process, capsys):
    class Interrupting(InProcessExecutor):
        def next_event(self, timeout=None):
            event = super().next_event(timeout)
            if isinstance(event, TrialCheckpointed):
                raise KeyboardInterrupt  # Ctrl-C after the retrain's first epoch
            return event

    results = {}
    for name, executor in (("whole", InProcessExecutor()), ("cut", Interrupting())):
        db = str(tmp_path / f"{name}.db")
        search = nas.experiment("nasbench201", max_models=2, epochs=1, store=db, workers=1)
        search.run()
        if name == "whole":
            results[name] = nas_retrain.retrain_selected(
                db, 1, "nasbench201", retrain_epochs=3, workers=1,
                executor=executor).retrained
            continue
        with pytest.raises(KeyboardInterrupt):
            nas_retrain.retrain_selected(db, 1, "nasbench201", retrain_epochs=3, workers=1,
                                         executor=executor)
        assert _phases(db)[-1][1] != "done"
        capsys.readouterr()
        assert main(["resume", db]) == 0
        assert "nasbench201: search" in capsys.readouterr().out
        assert _phases(db)[-1][1] == "done"
        results[name] = nas_retrain.finish(_phases(db)[-1][2]["nas_retrain"]).retrained
    assert results["cut"] == results["whole"]


@pytest.mark.slow
@pytest.mark.parametrize("name, search", [("darts", {"epochs": 3}),
                                          ("nasbench201", {"max_models": 4, "epochs": 2})])
def test_the_retrained_selection_meets_the_floor_on_digits(name, search, tmp_path):
    """#31's floor: a row's selection, retrained from scratch, reaches 0.9 val_acc on digits."""
    result = nas_retrain.search_and_retrain(name, store=str(tmp_path / f"{name}.db"),
                                            retrain_epochs=20, workers=2, **search)
    assert result.retrained["val_acc"] >= 0.9, result.line()


# ---- independent runs of the retraining (--retrain-seeds) ----------------------------------

def test_a_retraining_of_several_runs_is_the_mean_of_runs_that_a_single_run_gives(
        tmp_path, few_digits, in_process, capsys):
    """Run k of ``retrain_seeds=R`` is bit for bit the one-run retraining at seed + k, and the
    reported figure is the runs' mean; the CLI prints mean ± sd and a resume keeps R."""
    db = str(tmp_path / "nb.db")
    nas.experiment("nasbench201", max_models=2, epochs=1, store=db, workers=1).run()
    three = nas_retrain.retrain_selected(db, 1, "nasbench201", retrain_epochs=2, workers=1,
                                         seed=5, retrain_seeds=3)
    singles = [nas_retrain.retrain_selected(db, 1, "nasbench201", retrain_epochs=2, workers=1,
                                            seed=5 + k).retrained for k in range(3)]
    for run, single in zip(three.runs, singles):  # each run as its own one-run retraining
        assert (run["val_acc"], run["val_loss"]) == (single["val_acc"], single["val_loss"])
        # (the runs train in one grouped job, whose summed float32 training loss may round
        # its last bits otherwise than a job of one model in a one-thread process)
        assert run["train_loss"] == pytest.approx(single["train_loss"], rel=1e-6)
    assert len({r["val_loss"] for r in three.runs}) == 3  # seeds that differ, runs that do
    for metric in ("val_acc", "val_loss", "train_loss"):
        assert three.retrained[metric] == pytest.approx(sum(r[metric] for r in singles) / 3)
    values = [r["val_loss"] for r in singles]
    mean = sum(values) / 3
    assert three.spread("val_loss") == pytest.approx(
        (sum((v - mean) ** 2 for v in values) / 2) ** 0.5)
    assert "(mean ± sd of 3 runs)" in three.line()
    assert nas_retrain.NasResult("x", db, 1, 2, 0.0, 1, {}, None, {"val_acc": 1.0}, 2,
                                 runs=[{"val_acc": 1.0}]).spread() is None
    with Store(db) as store:  # the three runs: one model each, of the same architecture
        store.use_experiment(2)
        assert len({json.dumps(m["sample"], sort_keys=True) for m in store.models()}) == 1
        assert len(store.models()) == 3
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="retrain_seeds"):
            nas_retrain.retrain_selected(db, 1, "nasbench201", retrain_seeds=bad)
    # the CLI: --retrain-seeds recorded in both phases' origins, kept by a resume
    cli_db = str(tmp_path / "cli.db")
    capsys.readouterr()
    assert main(["nas", "run", "nasbench201", "--max-models", "2", "--epochs", "1",
                 "--retrain-epochs", "2", "--retrain-seeds", "2", "--store", cli_db,
                 "--workers", "1"]) == 0
    assert "(mean ± sd of 2 runs)" in capsys.readouterr().out
    (_, _, s_origin), (_, _, r_origin) = _phases(cli_db)
    assert s_origin["nas"]["retrain_seeds"] == 2 and r_origin["nas_retrain"]["retrain_seeds"] == 2
    assert main(["resume", cli_db]) == 0
    assert "(mean ± sd of 2 runs)" in capsys.readouterr().out
    assert main(["nas", "run", "nasbench201", "--retrain-seeds", "0", "--store", cli_db]) == 2
    assert "--retrain-seeds" in capsys.readouterr().err
