"""Large-Scale Evolution's weight inheritance (Real et al., ICML 2017): a child starts from its
parent's trained tensors where the mutation kept a layer's shape, fresh elsewhere; the engine
names the parent's checkpoint as the child's donor, and a resumed search equals an uninterrupted
one."""
from __future__ import annotations

import pytest
import torch

from retiarii import nas
from retiarii.engine.jobs.job import TrialTask
from retiarii.engine.storage import checkpoint as ckpt
from retiarii.engine.storage.store import Store
from retiarii.engine.trainers import inheritance
from retiarii.engine.trainers.trainer import ClassifierTrainer
from retiarii.engine.trainers.trial_training import TrialRun
from retiarii.engine.worker_side.worker import WorkerContext, _open_task  # noqa: PLC2701
from retiarii.strategies import RegularizedEvolution

SPACE = "retiarii.nas:SPACES.large_scale_evolution.small"
TRAINER = {"class": "retiarii.engine.trainers.trainer:ClassifierTrainer",
           "config": {"dataset": "digits", "epochs": 1}}

# two conv layers of 8 channels, 3x3; the child's second conv is 5x5 (one mutation)
PARENT = {"lse/grow0": True, "lse/kind0": "insert_conv", "lse/before0": "flatten",
          "lse/channels0": 8, "lse/kernel0": 3, "lse/grow1": True, "lse/kind1": "insert_conv",
          "lse/before1": "flatten", "lse/channels1": 8, "lse/kernel1": 3, "lse/grow2": False,
          "lr": 0.003}
CHILD = {**PARENT, "lse/kernel1": 5}


def test_layers_whose_shape_the_mutation_kept_are_inherited_the_changed_one_starts_fresh(
        tmp_path):
    space = nas.build_space("large_scale_evolution", "small")
    parent = TrialRun(lambda: space.build(PARENT), ClassifierTrainer(dataset="digits", epochs=1),
                      seed=3)
    untrained = {k: v.clone() for k, v in parent.model.state_dict().items()}
    parent.train_epoch()
    path = str(tmp_path / "parent.pt")
    parent.save(path)
    trained = parent.model.state_dict()

    spec = {"space": SPACE, "trainer": TRAINER, "sample": CHILD, "seed": 5}
    context = WorkerContext()
    child = _open_task(TrialTask("child", {**spec, "inherit": "parent.pt"}, 0, 1, path, None),
                       context)
    fresh = _open_task(TrialTask("fresh", spec, 0, 1, None, None), context)
    start, alone = child.model.state_dict(), fresh.model.state_dict()
    changed = {k for k in start if k.startswith("lse_1_conv.")}
    assert changed == {"lse_1_conv.weight", "lse_1_conv.bias"}
    for name, tensor in start.items():
        if name in changed:  # the 5x5 conv: what a fresh trial of the child starts from
            assert torch.equal(tensor, alone[name]), name
        else:  # every other layer: the parent's trained tensors
            assert torch.equal(tensor, trained[name]), name
    # the parent did train (inheriting its initial weights would pass the loop above too)
    assert not torch.equal(trained["lse_0_conv.weight"], untrained["lse_0_conv.weight"])
    # and the child trains from step 0, with its own fresh optimizer
    assert child.step == 0 and not child.optimizer.state


def test_a_child_of_an_unreadable_parent_checkpoint_fails_naming_the_file(tmp_path):
    bad = tmp_path / "gone.pt"
    bad.write_bytes(b"not a checkpoint")
    spec = {"space": SPACE, "trainer": TRAINER, "sample": CHILD, "seed": 5, "inherit": "gone.pt"}
    with pytest.raises(Exception, match="gone.pt"):
        _open_task(TrialTask("child", spec, 0, 1, str(bad), None), WorkerContext())


def _experiment(store, max_models, executor=None):
    import retiarii as rt

    strategy = RegularizedEvolution(population_size=2, sample_size=1, initial="base",
                                    inherit=True, seed=0)
    kwargs = {"executor": executor} if executor is not None else {"workers": 1}
    return rt.Experiment(SPACE, strategy, ClassifierTrainer(dataset="digits", epochs=1),
                         store=str(store), max_models=max_models, seed=0, fuse=False,
                         # one model a job: a child is proposed once its parent is trained
                         # (a child of a parent still training starts fresh: nothing to inherit)
                         batch_models=1, **kwargs)


def _trials(store):
    with Store(str(store)) as s:
        s.use_experiment(s.experiments()[-1]["id"])
        models = {m["id"]: m for m in s.models()}
        return [(t["spec"]["choices"], t["spec"].get("inherit"),
                 models[t["model_id"]]["parent"], dict(s.learning_curve(t["id"], "val_acc")))
                for t in s.trials()]


def test_the_engine_starts_each_child_from_its_parents_checkpoint(tmp_path, monkeypatch):
    from engine_helpers import InProcessExecutor

    starts = {}
    real = inheritance.inherit_from

    def spy(run, path):
        out = real(run, path)
        starts[run.trial_id] = (path, {k: v.clone() for k, v in run.model.state_dict().items()},
                                out)
        return out

    monkeypatch.setattr(inheritance, "inherit_from", spy)
    _experiment(tmp_path / "e.db", 6, InProcessExecutor()).run()
    rows = _trials(tmp_path / "e.db")
    children = [r for r in rows if r[2] is not None]
    assert len(children) >= 3 and all(r[1] for r in children)  # every child inherits
    assert all(r[1] is None for r in rows if r[2] is None)  # the base model starts fresh
    assert len(starts) == len(children)
    for path, state, (kept, fresh) in starts.values():
        parent = ckpt.load(path)["model"]  # the parent's checkpoint, still on disk
        assert all(torch.equal(state[k], parent[k]) for k in kept)
        for k in fresh:  # a fresh tensor's layer changed: some tensor of it does not fit
            layer = [j for j in state if j.rpartition(".")[0] == k.rpartition(".")[0]]
            assert any(j not in parent or parent[j].shape != state[j].shape for j in layer)
    # (a conv inserted before the classifier changes its input size: it starts fresh)
    assert any(kept for _, _, (kept, _) in starts.values())


@pytest.mark.slow
def test_a_resumed_inheriting_search_equals_the_uninterrupted_one(tmp_path):
    whole = tmp_path / "whole.db"
    _experiment(whole, 6).run()
    parts = tmp_path / "parts.db"
    _experiment(parts, 3).run()
    _experiment(parts, 6).resume()
    a, b = _trials(whole), _trials(parts)
    assert [r[0] for r in a] == [r[0] for r in b]
    assert [r[3] for r in a] == [r[3] for r in b]  # the same metrics, bit for bit
    assert sum(r[1] is not None for r in a) >= 3


class _Ops:
    ops = ["conv", "pool", "skip"]

    def sample(self, sampler):
        s = {}
        for i in range(3):
            s[f"op{i}"] = self.ops[sampler.choose(f"op{i}", self.ops, dict(s))]
        return type("Model", (), {"sample": s})()


def _score(sample: dict) -> float:
    return float(sum((op == "conv") * (i + 1) for i, op in enumerate(sample.values())))


def test_the_worse_of_two_is_killed_and_the_better_reproduces():
    from retiarii.sampler import sample_key

    space = _Ops()
    evo = RegularizedEvolution(population_size=4, sample_size=2, kill="worse", seed=0)
    for _ in range(4):
        s = evo.ask(space)
        evo.tell(s, _score(s))
    for _ in range(12):
        before = dict(evo._population)
        child = evo.ask(space)
        after = dict(evo._population)
        parent = sample_key(evo.parent_of(child))
        (dead,) = before.keys() - after.keys()  # exactly one member killed: the pair's worse
        assert parent in after and before[dead] <= before[parent]
        assert not after.keys() - before.keys()  # nothing aged out, nothing joined yet
        evo.tell(child, _score(child))
        assert len(evo._population) == 4  # the child took the dead one's place
    # state round trip: a restored search continues as the uninterrupted one
    copy = RegularizedEvolution(population_size=4, sample_size=2, kill="worse", seed=0)
    copy.load_state_dict(evo.state_dict())
    for e in (evo, copy):
        for _ in range(5):
            s = e.ask(space)
            e.tell(s, _score(s))
    assert list(evo._population) == list(copy._population)
    with pytest.raises(ValueError, match="kill"):
        RegularizedEvolution(kill="youngest")


def test_the_row_runs_the_papers_selection_with_inheritance():
    evo = nas.strategy("large_scale_evolution", seed=0)
    assert (evo.kill, evo.sample_size, evo.inherit_weights, evo.initial) == \
        ("worse", 2, True, "base")
    assert nas.get("large_scale_evolution").status == "faithful"
