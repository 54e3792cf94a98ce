"""Frozen parameters, Trainer.data_key and the logical plan's identity keys."""
import pytest
import torch
from torch import nn

import retiarii as rt
from retiarii.engine.trainers.trainer import ClassifierTrainer
from retiarii.modspec import is_frozen
from retiarii.optim.plan import PlanError, PlanModel, Role, build_plan
from retiarii.space import SpaceError


class Backbone(nn.Module):
    """A frozen stem (Linear + ReLU) feeding a trainable head the mutator swaps."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 12)
        self.act = nn.ReLU()
        self.head = nn.Linear(12, 3)
        self.stem.requires_grad_(False)
        self.scale = nn.Parameter(torch.randn(12), requires_grad=False)

    def forward(self, x):
        return self.head(self.act(self.stem(x)) * self.scale)


def heads():
    return rt.apply_mutator("head", rt.mutators.OperatorMutator(
        {"lin": nn.Linear(12, 3), "mlp": nn.Sequential(nn.Linear(12, 5), nn.Tanh(),
                                                     nn.Linear(5, 3))}, label="head"))


def make_space(seed=0, mutators=None):
    torch.manual_seed(seed)
    return rt.ModelSpace(Backbone(), [heads()] if mutators is None else mutators,
                         example_input=torch.randn(2, 6))


# ---- frozen parameters ----------------------------------------------------------------------

def test_trace_marks_frozen_modules_only():
    g = make_space().bases[0][0]
    assert g["stem"].op.spec["frozen"] is True
    assert "frozen" not in g["head"].op.spec and "frozen" not in g["act"].op.spec
    # Frozen means weights that do not train: a BatchNorm whose affine weights do not is
    # frozen, its running statistics its state (optim/state.py); one that trains is not.
    bn = nn.BatchNorm1d(4).requires_grad_(False)
    assert rt.trace(nn.Sequential(bn))["0"].op.spec["frozen"] is True
    assert "frozen" not in rt.trace(nn.Sequential(nn.BatchNorm1d(4)))["0"].op.spec

    class Counter(nn.Module):  # a user's buffer: state the engine cannot read, never frozen
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4).requires_grad_(False)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen += 1
            return self.lin(x)

    assert not is_frozen(Counter()) and is_frozen(nn.Sequential(nn.Linear(4, 4), bn).requires_grad_(False))


def test_build_gives_every_model_the_base_values_frozen():
    torch.manual_seed(0)
    base = Backbone()
    space = rt.ModelSpace(base, [heads()], example_input=torch.randn(2, 6))
    for seed, sample in enumerate([{"head/head": "lin"}, {"head/head": "mlp"}]):
        torch.manual_seed(seed + 10)  # each trial its own seed: trainable weights differ
        model = space.build(sample)
        assert torch.equal(model.stem.weight, base.stem.weight)
        assert torch.equal(model.scale, base.scale)
        assert not model.stem.weight.requires_grad and not model.scale.requires_grad
        assert model.head.weight.requires_grad if sample["head/head"] == "lin" else True
    # the base sample, built, computes what the base model computes
    model = space.build({"head/head": "lin"})
    model.head.load_state_dict(base.head.state_dict())
    x = torch.randn(5, 6)
    assert torch.equal(model(x), base(x))


def test_a_replaced_frozen_node_gets_new_trainable_weights():
    space = make_space(mutators=[rt.apply_mutator("stem", rt.mutators.OperatorMutator(
        {"keep": nn.Linear(6, 12), "other": nn.Linear(6, 12, bias=False)}, label="stem"))])
    model = space.replay({"stem/stem": "other"})
    assert model.graph["stem"].uid in model.changed_ops()
    assert model.graph["stem"].uid not in space.frozen_nodes(model)
    assert space.build({"stem/stem": "other"}).stem.weight.requires_grad


def test_frozen_fingerprint_detects_other_values():
    a, b, c = make_space(seed=0), make_space(seed=0), make_space(seed=1)
    assert a.frozen_fingerprint() == b.frozen_fingerprint() != c.frozen_fingerprint()
    a.check_frozen(b.frozen_fingerprint())
    with pytest.raises(SpaceError, match="deterministic"):
        a.check_frozen(c.frozen_fingerprint())
    plain = rt.ModelSpace(nn.Sequential(nn.Linear(2, 2)))
    assert plain.frozen_fingerprint() is None


def test_the_experiment_records_the_frozen_fingerprint():
    from retiarii.engine.driver.experiment_support import space_fingerprint as _space_fingerprint
    space = make_space()
    assert _space_fingerprint(space)["frozen"] == space.frozen_fingerprint()
    assert "frozen" not in _space_fingerprint(rt.ModelSpace(nn.Sequential(nn.Linear(2, 2))))


# ---- data keys ------------------------------------------------------------------------------

def test_classifier_data_key_names_what_decides_the_batches():
    t = ClassifierTrainer(batch_size=32, seed=3)
    key = t.data_key({})
    assert key == ClassifierTrainer(batch_size=32, seed=3, lr=0.5, epochs=2).data_key({"lr": 1})
    assert key != t.data_key({"batch_size": 16})
    assert key != t.data_key({"seed": 4})
    assert key != t.data_key({"split_seed": 1})
    assert key != ClassifierTrainer(batch_size=32, seed=3, val_fraction=0.3).data_key({})
    # equal keys: equal batches
    a, b = t.train_dataloader({}, 1), ClassifierTrainer(batch_size=32, seed=3, lr=9.0) \
        .train_dataloader({}, 1)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))


def test_data_key_of_tensors_and_of_subclasses():
    x, y = torch.randn(20, 3), torch.randint(0, 2, (20,))
    k1 = ClassifierTrainer(dataset=(x, y)).data_key({})
    assert k1 == ClassifierTrainer(dataset=(x.clone(), y.clone())).data_key({})
    assert k1 != ClassifierTrainer(dataset=(x + 1, y)).data_key({})

    class Augmenting(ClassifierTrainer):
        def train_dataloader(self, hparams, epoch):
            return super().train_dataloader(hparams, epoch)

    assert Augmenting().data_key({}) is None
    assert rt.Trainer.data_key(Augmenting(), {}) is None  # the base shares nothing


# ---- identity keys --------------------------------------------------------------------------

def test_keys_follow_origin_not_structure():
    space = make_space()
    a, b, c = (space.replay({"head/head": h}) for h in ("lin", "mlp", "lin"))
    plan = build_plan([PlanModel("a", a, "d"), PlanModel("b", b, "d"), PlanModel("c", c, "d")])
    ka, kb, kc = (plan.keys[t] for t in "abc")
    for name in ("x", "stem", "act", "scale"):
        assert ka[a.graph[name].uid] == kb[b.graph[name].uid] == kc[c.graph[name].uid]
    assert plan.nodes[ka[a.graph["stem"].uid]].role is Role.FROZEN
    assert plan.nodes[ka[a.graph["act"].uid]].role is Role.PURE
    # a trainable node is the model's own even when two models hold the same structure
    assert ka[a.graph["head"].uid] != kc[c.graph["head"].uid]
    assert plan.nodes[ka[a.graph["head"].uid]].role is Role.OWN


def test_the_data_key_roots_the_keys():
    space = make_space()
    m = space.replay({"head/head": "lin"})
    plan = build_plan([PlanModel("a", m, "d1"), PlanModel("b", m, "d2"),
                       PlanModel("c", m, None), PlanModel("d", m, None)])
    roots = [plan.data_roots(t) for t in "abcd"]
    assert len(set(roots)) == 4
    stem = m.graph["stem"].uid
    assert len({plan.keys[t][stem] for t in "abcd"}) == 4  # Merkle: other data, other key


def test_created_nodes_are_keyed_by_the_record_and_choices_that_made_them():
    class Insert(rt.Mutator):
        def mutate(self, targets):
            act, = targets
            op = self.choose({"relu": nn.ReLU(), "tanh": nn.Tanh()}, label="extra")
            width = self.choose([1, 2], label="width")
            node = self.create_node("extra", op)
            users = [(u, p) for u, p in self.graph.out_edges(act)]
            self.connect(act, node)
            for user, port in users:
                self.connect(node, user, port)
            del width

    space = make_space(mutators=[rt.apply_mutator(["act"], Insert())])
    models = {s: space.replay(dict(zip(["extra", "width"], s)))
              for s in [("relu", 1), ("relu", 2), ("tanh", 1)]}
    plan = build_plan([PlanModel(str(i), m, "d") for i, m in enumerate(models.values())] +
                      [PlanModel("again", models[("relu", 1)], "d")])
    key = {t: plan.keys[t][plan.model(t).model.graph["extra"].uid] for t in plan.keys}
    assert key["0"] == key["again"]  # same choices before the record: the same node
    # both choices precede the create_node record: another width is another history
    assert len({key["0"], key["1"], key["2"]}) == 3


def test_plan_errors():
    m = make_space().replay({"head/head": "lin"})
    with pytest.raises(PlanError, match="unique"):
        build_plan([PlanModel("a", m, "d"), PlanModel("a", m, "d")])
