"""The CSE pass, tested as torch.fx tests its CSE pass: exact reduction, idempotent, `modified`
honest, and a random-program fuzz test whose reference is each model run alone."""
import copy
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import retiarii as rt
from retiarii.engine.storage import checkpoint as ckpt
from retiarii.optim.build import build_group
from retiarii.optim.cse import cse
from retiarii.optim.plan import PlanModel, Role, build_plan


class Backbone(nn.Module):
    def __init__(self, frozen=True, drop=False, inplace=False):
        super().__init__()
        self.stem = nn.Linear(6, 12)
        self.act = nn.ReLU(inplace=inplace)
        self.drop = nn.Dropout(0.5) if drop else nn.Identity()
        self.head = nn.Linear(12, 3)
        self.stem.requires_grad_(not frozen)
        self.scale = nn.Parameter(torch.randn(12), requires_grad=False)

    def forward(self, x):
        return self.head(self.drop(self.act(self.stem(x))) * self.scale)


class Text(nn.Module):
    """A frozen embedding feeding a trainable head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.emb.weight.requires_grad_(False)
        self.head = nn.Linear(8, 2)

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(1))


HEADS = {"lin": lambda i: nn.Linear(i, 3), "mlp": lambda i: nn.Sequential(
    nn.Linear(i, 5), nn.Tanh(), nn.Linear(5, 3))}


def space_of(base, width, example):
    torch.manual_seed(0)
    return rt.ModelSpace(base, [rt.apply_mutator("head", rt.mutators.OperatorMutator(
        {k: f(width) for k, f in HEADS.items()}, label="h"))], example_input=example)


def plan_of(space, n, data_key="d"):
    samples = itertools.islice(itertools.cycle(space.enumerate()), n)
    return build_plan([PlanModel(f"t{i}", m, data_key) for i, m in enumerate(samples)])


@pytest.mark.parametrize("n", [2, 3, 8])
def test_frozen_prefix_feeding_n_heads(n):
    plan = plan_of(space_of(Backbone(), 12, torch.randn(2, 6)), n)
    # x stem act drop scale mul head output: 8 nodes per model
    assert plan.executions() == 8 * n
    result = cse(plan)
    assert result.modified
    # x, stem, act, drop (Identity), scale, mul once; head and output per model
    assert result.plan.executions() == 6 + 2 * n
    assert {result.plan.nodes[k].name for k in result.plan.shared} == \
        {"x", "stem", "act", "drop", "scale", "mul"}
    assert result.plan.groups() == [tuple(f"t{i}" for i in range(n))]


def test_frozen_embedding():
    plan = plan_of(space_of(Text(), 8, torch.randint(0, 50, (2, 7))), 4)
    assert plan.executions() == 5 * 4  # tokens emb mean head output
    assert cse(plan).plan.executions() == 3 + 2 * 4


class Encoder(nn.Module):
    """A frozen embedding and nn.TransformerEncoder (an opaque node: fx keeps torch.nn
    layers whole) feeding a trainable head: a frozen text encoder and its task head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8))
        self.emb.requires_grad_(False)
        self.enc.requires_grad_(False)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):  # (B, L) -> (B, L, 8) -> (B, 3)
        return self.head(self.enc(self.emb(tokens)).mean(1))


@pytest.mark.parametrize("train", [True, False])
def test_frozen_transformer_encoder_is_computed_once(train):
    space = space_of(Encoder(), 8, torch.randint(0, 50, (2, 7)))
    assert space.bases[0][0]["enc"].op.spec["frozen"] is True
    plan = plan_of(space, 4)
    assert plan.executions() == 6 * 4  # tokens emb enc mean head output
    result = cse(plan)
    assert result.plan.executions() == 4 + 2 * 4
    assert {result.plan.nodes[k].name for k in result.plan.shared} == {"tokens", "emb", "enc", "mean"}
    # one encoder object serves the group, and each model's output is its output alone
    built = {m.trial_id: space.build(m.model.sample, check=False) for m in result.plan.models}
    alone = {t: copy.deepcopy(m).train(train) for t, m in built.items()}
    module = build_group(result.plan, built).train(train)
    assert len({id(m.enc) for m in built.values()}) == 1
    x = torch.randint(0, 50, (5, 7))
    got = module(x)
    for t, model in alone.items():
        assert torch.equal(got[t], model(x)), t


def test_trainable_prefix_shares_only_the_data_and_frozen_tensors():
    plan = cse(plan_of(space_of(Backbone(frozen=False), 12, torch.randn(2, 6)), 3)).plan
    assert {plan.nodes[k].name for k in plan.shared} == {"x", "scale"}
    assert plan.executions() == 2 + 6 * 3


def test_random_operations_stop_sharing():
    plan = cse(plan_of(space_of(Backbone(drop=True), 12, torch.randn(2, 6)), 3)).plan
    assert {plan.nodes[k].name for k in plan.shared} == {"x", "stem", "act", "scale"}
    drop = next(k for k, n in plan.nodes.items() if n.name == "drop")
    assert plan.nodes[drop].role is Role.OWN


def test_in_place_on_a_frozen_layer_output_read_by_nothing_else_is_shared():
    plan = cse(plan_of(space_of(Backbone(inplace=True), 12, torch.randn(2, 6)), 2)).plan
    assert "act" in {plan.nodes[k].name for k in plan.shared}


def test_idempotent_and_modified_honest():
    plan = plan_of(space_of(Backbone(), 12, torch.randn(2, 6)), 4)
    once = cse(plan)
    twice = cse(once.plan)
    assert twice.modified is False and twice.plan is once.plan
    assert twice.plan.shared == once.plan.shared


def test_nothing_to_share_is_not_modified():
    space = space_of(Backbone(), 12, torch.randn(2, 6))
    models = list(space.enumerate())
    for plan in (build_plan([PlanModel("a", models[0], "d1"), PlanModel("b", models[1], "d2")]),
                 build_plan([PlanModel("a", models[0], None), PlanModel("b", models[0], None)]),
                 build_plan([PlanModel("a", models[0], "d")])):
        result = cse(plan)
        assert result.modified is False and result.plan.shared == frozenset()
        assert result.plan.executions() == plan.executions()


def test_restrict_keeps_what_the_subset_shares():
    plan = cse(plan_of(space_of(Backbone(), 12, torch.randn(2, 6)), 4)).plan
    sub = plan.restrict(["t1", "t3"])
    assert sub.executions() == 6 + 2 * 2
    assert plan.restrict(["t2"]).shared == frozenset()


# ---- fuzz: random spaces, random batches; reference: every model run alone ---------------

LAYERS = {
    "lin": lambda: nn.Linear(6, 6), "lin*": lambda: nn.Linear(6, 6).requires_grad_(False),
    "ln*": lambda: nn.LayerNorm(6).requires_grad_(False), "ln": lambda: nn.LayerNorm(6),
    "relu": nn.ReLU, "relu_": lambda: nn.ReLU(inplace=True), "tanh": nn.Tanh,
    "drop": lambda: nn.Dropout(0.3), "bn*": lambda: nn.BatchNorm1d(6).requires_grad_(False),
}
CANDIDATES = {"lin": lambda: nn.Linear(6, 6), "tanh": nn.Tanh, "id": nn.Identity,
              "drop": lambda: nn.Dropout(0.2)}


@st.composite
def programs(draw):
    layers = draw(st.lists(st.sampled_from(sorted(LAYERS)), min_size=1, max_size=6))
    targets = draw(st.lists(st.integers(0, len(layers) - 1), max_size=2, unique=True))
    cands = [draw(st.lists(st.sampled_from(sorted(CANDIDATES)), min_size=1, max_size=3,
                           unique=True)) for _ in targets]
    n = draw(st.integers(1, 5))
    picks = draw(st.lists(st.integers(0, 10 ** 6), min_size=n, max_size=n))
    keys = draw(st.lists(st.sampled_from(["a", "a", "b", None]), min_size=n, max_size=n))
    train = draw(st.booleans())
    return layers, list(zip(targets, cands)), picks, keys, train


def _alone_output(model, x, seed):
    ckpt.seed_rng(seed)
    return model(x)


@settings(max_examples=30, deadline=None)
@given(programs())
def test_fuzz_cse_is_sound(program):
    layers, mutations, picks, keys, train = program
    torch.manual_seed(0)
    base = nn.Sequential(*[LAYERS[name]() for name in layers], nn.Linear(6, 2))
    mutators = [rt.apply_mutator(str(i), rt.mutators.OperatorMutator(
        {c: CANDIDATES[c]() for c in cands}, label=f"m{i}")) for i, cands in mutations]
    space = rt.ModelSpace(base, mutators, example_input=torch.randn(3, 6))
    models = list(space.enumerate())
    batch = [PlanModel(f"t{i}", models[p % len(models)], k)
             for i, (p, k) in enumerate(zip(picks, keys))]
    plan = build_plan(batch)
    result = cse(plan)
    shared = result.plan.shared
    assert result.modified == (shared != plan.shared)
    assert cse(result.plan).modified is False
    assert result.plan.executions() <= plan.executions()
    for key in shared:
        node = result.plan.nodes[key]
        assert node.role is not Role.OWN and len(node.holders) > 1
        assert all(src in shared for src in node.inputs)
    # The reference: each model alone, with its own RNG stream, equals its group's output.
    x = torch.randn(4, 6)
    for group in result.plan.groups():
        sub = result.plan.restrict(group)
        built = {t: space.build(sub.model(t).model.sample, check=False) for t in group}
        alone = {t: copy.deepcopy(m).train(train) for t, m in built.items()}
        # (each alone model gets its own copy of the batch: a model may write its input)
        expected = {t: _alone_output(alone[t], x.clone(), seed=i) for i, t in enumerate(group)}
        states = {}
        for i, t in enumerate(group):
            ckpt.seed_rng(i)
            states[t] = ckpt.native_rng()
        module = build_group(sub, built).train(train)
        got = module(x.clone(), rng={t: _swap(states, t) for t in group})
        for t in group:
            assert torch.equal(got[t], expected[t]), (t, result.plan.describe())
            # a frozen BatchNorm ran once for its holders: each holds what it holds alone
            mine, ref = built[t].state_dict(), alone[t].state_dict()
            assert all(torch.equal(mine[k], ref[k]) for k in ref), (t, result.plan.describe())


def _swap(states, trial):
    import contextlib

    @contextlib.contextmanager
    def swapped():
        outer = ckpt.native_rng()
        ckpt.set_native_rng(states[trial])
        try:
            yield
        finally:
            states[trial] = ckpt.native_rng()
            ckpt.set_native_rng(outer)
    return swapped
