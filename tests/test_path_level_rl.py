"""Path-level NAS as the paper runs it (Cai et al., ICML 2018): transformed networks start from
the trained start network's weights and compute its function; a bidirectional tree-LSTM
meta-controller decides node by node, and REINFORCE moves it towards rewarded decisions."""
from __future__ import annotations

import pytest
import torch

from retiarii import nas
from retiarii.engine.jobs.job import TrialTask
from retiarii.engine.trainers.trainer import ClassifierTrainer
from retiarii.engine.trainers.trial_training import TrialRun
from retiarii.engine.worker_side.worker import WorkerContext, _open_task  # noqa: PLC2701
from retiarii.strategies.multi_trial import path_level_rl as plrl
from retiarii.strategies.multi_trial.base import SpaceExhausted
from retiarii.strategies.multi_trial.tree_lstm import TreeLSTM

SPACE = "retiarii.nas:SPACES.path_level.small"
TRAINER = {"class": "retiarii.engine.trainers.trainer:ClassifierTrainer",
           "config": {"dataset": "digits", "epochs": 1}}
# one chain per transformation type, each ending with it (earlier steps: other types)
CHAINS = {"replicate": [["r", "replicate", None]],
          "split": [["r", "split", None]],
          "deepen": [["r", "deepen", None]],
          "all three": [["r", "split", None], ["r.1", "replicate", None],
                        ["r.0", "deepen", None], ["r.1.0", "split", None]]}


@pytest.fixture(scope="module")
def trained_start(tmp_path_factory):
    """The start network trained one epoch on digits, its checkpoint on disk."""
    space = nas.build_space("path_level", "small")
    run = TrialRun(lambda: space.build(dict(plrl.START)),
                   ClassifierTrainer(dataset="digits", epochs=1), seed=3)
    run.train_epoch()
    path = str(tmp_path_factory.mktemp("start") / "start.pt")
    run.save(path)
    return run.model.eval(), path


def _child(steps, checkpoint, inherit=True):
    spec = {"space": SPACE, "trainer": TRAINER, "sample": plrl.to_sample(steps), "seed": 5}
    if inherit:
        spec["inherit"] = "start.pt"
    return _open_task(TrialTask("child", spec, 0, 1, checkpoint if inherit else None, None),
                      WorkerContext()).model.eval()


@pytest.mark.parametrize("kind", list(CHAINS))
def test_a_child_opened_by_the_worker_computes_its_trained_parents_function(trained_start,
                                                                            kind):
    start, checkpoint = trained_start
    x = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = start(x)
        child = _child(CHAINS[kind], checkpoint)
        torch.testing.assert_close(child(x), expected, rtol=1e-5, atol=1e-5)
        # the same child without inheritance computes something else (the test can fail)
        assert not torch.allclose(_child(CHAINS[kind], checkpoint, inherit=False)(x),
                                  expected, atol=1e-3)


def test_a_new_edges_op_starts_fresh_and_the_rest_is_inherited(trained_start):
    start, checkpoint = trained_start
    steps = [["r", "deepen", None], ["r.1", "change_op", "conv_1x1"]]
    child = _child(steps, checkpoint)
    ref = dict(start.state_dict())
    for name, tensor in child.state_dict().items():
        if ".cell.tree.parts.0." in name:  # the deepened node's first part: the old conv
            old = name.replace(".cell.tree.parts.0.", ".cell.tree.")
            assert torch.equal(tensor, ref[old]), name
        elif ".cell." not in name:  # outside the cells: by name
            assert torch.equal(tensor, ref[name]), name


def test_a_cell_inherits_from_an_intermediate_ancestor_and_refuses_a_stranger():
    from model_spaces.path_level import Cell
    from model_spaces.path_tree import apply

    steps = CHAINS["all three"]
    trees = [["op", "conv_3x3"]]
    for path, kind, op in steps:
        trees.append(apply(trees[-1], path, kind, 8, op))
    torch.manual_seed(0)
    parent = Cell(trees[2], 32, 8, steps[:2]).eval()  # two steps in
    for m in parent.modules():  # trained-looking statistics (fresh ones are 0 / 1)
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5), m.running_var.uniform_(0.5, 1.5)
    child = Cell(trees[-1], 32, 8, steps).eval()
    assert child.inherit_state(parent.state_dict())
    x = torch.randn(4, 32, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(child(x), parent(x), rtol=1e-5, atol=1e-5)
    stranger = Cell(["op", "sep_conv_3x3"], 32, 8).state_dict()
    assert not child.inherit_state(stranger)


def test_the_walk_decides_once_per_node_in_pre_order_down_to_max_depth():
    seen = []

    def decide(tree, path, allowed):  # replicate the root, split its first copy
        seen.append((path, allowed))
        return {"r": ("replicate", None), "r.0": ("split", None)}.get(path, ("none", None))

    steps = plrl.traverse(["op", "conv_3x3"], 8, 2, decide)
    assert steps == [["r", "replicate", None], ["r.0", "split", None]]
    # r; its two copies; r.0's two halves (depth 2); r.1 has no children
    assert [p for p, _ in seen] == ["r", "r.0", "r.0.0", "r.0.1", "r.1"]
    assert seen[0][1] == ["none", "replicate", "split", "deepen"]
    seen.clear()
    assert plrl.traverse(["op", "conv_3x3"], 8, 1, decide) == steps
    assert [p for p, _ in seen] == ["r", "r.0", "r.1"]  # depth 1: r.0's halves not decided
    # an identity edge is offered a new op
    seen.clear()
    plrl.traverse(["op", "conv_3x3"], 8, 1,
                  lambda t, p, a: seen.append(a) or (("deepen", None) if p == "r" else
                                                     ("none", None)))
    assert seen[2] == ["none", "replicate", "deepen", "change_op"]  # r.1: the identity


def test_the_controller_decides_at_the_walks_nodes_with_its_heads():
    s = plrl.PathLevelRL(seed=0, max_depth=1)
    s.check(nas.build_space("path_level", "small"))
    calls = []

    def pick(path, what, lp):  # always replicate, and record where the heads were asked
        calls.append((path, what, len(lp)))
        return plrl.ACTIONS.index("replicate")

    totals = [torch.zeros(()), torch.zeros(())]
    with torch.no_grad():
        steps = plrl.traverse(list(plrl.BASE_CELL), 8, 1, s._decide(pick, totals))
    assert calls == [("r", "action", 5), ("r.0", "action", 5), ("r.1", "action", 5)]
    assert steps == [["r", "replicate", None], ["r.0", "replicate", None],
                     ["r.1", "replicate", None]]
    assert totals[0] < 0  # three log-probabilities added up


def test_the_tree_lstm_is_bidirectional():
    enc = TreeLSTM(plrl.TOKENS, 16, seed=0)
    a = ["add", [["op", "conv_3x3"], ["op", "conv_1x1"]]]
    b = ["add", [["op", "conv_3x3"], ["op", "max_pool_3x3"]]]
    with torch.no_grad():
        ea, eb = enc(a), enc(b)
    assert set(ea) == {"r", "r.0", "r.1"} and ea["r"].shape == (32,)
    assert not torch.equal(ea["r"][:16], eb["r"][:16])  # bottom-up: the root sees its leaves
    # top-down: r.0 is the same leaf in both, but its sibling differs
    assert torch.equal(ea["r.0"][:16], eb["r.0"][:16])
    assert not torch.equal(ea["r.0"][16:], eb["r.0"][16:])


def test_the_start_network_comes_first_and_children_wait_for_it_then_inherit_it():
    space = nas.build_space("path_level", "small")
    s = plrl.PathLevelRL(seed=0)
    start = s.ask(space)
    assert start == plrl.START and s.parent_of(start) is None
    with pytest.raises(SpaceExhausted, match="waiting for the start network"):
        s.ask(space)
    s.tell(start, 0.5)
    child = s.ask(space)
    assert s.parent_of(child) == plrl.START and s.inherit_weights
    assert plrl.steps_of(child) and plrl.to_sample(plrl.steps_of(child)) == child


def test_a_reinforce_step_raises_the_probability_of_a_rewarded_walk_and_lowers_a_punished():
    space = nas.build_space("path_level", "small")
    s = plrl.PathLevelRL(seed=1)
    s.tell(s.ask(space), 0.5)
    first, good, bad = s.ask(space), s.ask(space), s.ask(space)
    s.tell(first, 0.5)  # sets the baseline (advantage 0)
    before_good, before_bad = s.probability(space, good), s.probability(space, bad)
    s.tell(good, 1.0)
    after_good = s.probability(space, good)
    assert after_good > before_good
    before_bad = s.probability(space, bad)
    s.tell(bad, 0.0)
    assert s.probability(space, bad) < before_bad
    # the state round-trips: a restored controller gives the same probabilities
    restored = plrl.PathLevelRL(seed=1)
    restored.load_state_dict(s.state_dict())
    assert restored.probability(space, good) == pytest.approx(s.probability(space, good))


def test_a_sample_the_walk_cannot_give_teaches_nothing_and_bad_settings_are_refused():
    space = nas.build_space("path_level", "small")
    s = plrl.PathLevelRL(seed=0)
    s.check(space)
    with pytest.raises(ValueError, match="not a walk"):  # r.1 before r.0: not pre-order
        s.probability(space, plrl.to_sample([["r", "replicate", None],
                                             ["r.1", "split", None], ["r.0", "split", None]]))
    with pytest.raises(ValueError, match="max_depth"):
        plrl.PathLevelRL(max_depth=-1)
    with pytest.raises(ValueError, match="REINFORCE"):
        plrl.PathLevelRL(algorithm="ppo")
    with pytest.raises(ValueError, match="path_level.py's space"):
        plrl.PathLevelRL(seed=0).check(nas.build_space("nasbench201", "small"))


def test_the_row_runs_the_tree_controller():
    assert nas.get("path_level").runs_with == "PathLevelRL"
    assert nas.get("path_level").status == "faithful"
    assert isinstance(nas.strategy("path_level", seed=0), plrl.PathLevelRL)


def test_an_in_process_search_trains_the_start_network_then_inheriting_children(tmp_path):
    from engine_helpers import InProcessExecutor

    from retiarii.engine.storage.store import Store

    db = str(tmp_path / "pl.db")
    nas.experiment("path_level", max_models=3, epochs=1, store=db, seed=0, fuse=False,
                   batch_models=1, executor=InProcessExecutor()).run()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        models = {m["id"]: m for m in store.models()}
        trials = store.trials()
    start = [m for m in models.values() if m["sample"] == plrl.START]
    assert len(start) == 1 and start[0]["parent"] is None
    children = [t for t in trials if models[t["model_id"]]["parent"] is not None]
    assert len(children) == 2
    assert all(models[t["model_id"]]["parent"] == start[0]["id"] and t["spec"].get("inherit")
               for t in children)  # each from the start network's checkpoint
    assert all(m["value"] is not None for m in models.values())


@pytest.mark.slow
def test_nas_run_path_level_end_to_end(tmp_path, capsys):
    from retiarii.cli import main

    db = str(tmp_path / "pl.db")
    assert main(["nas", "run", "path_level", "--max-models", "3", "--epochs", "1",
                 "--workers", "1", "--retrain-epochs", "0", "--store", db]) == 0
    assert "path_level" in capsys.readouterr().out
