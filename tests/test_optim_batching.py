"""The batching pass, tested as the CSE pass is: exact reduction, idempotent, `modified`
honest, what must never be batched, a random-space fuzz test whose reference is each model
alone (outputs and gradients), and training through a group equal to training each alone."""
import copy

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import retiarii as rt
from retiarii.engine.storage import checkpoint as ckpt
from retiarii.optim.batching import batch_independent, batching
from retiarii.optim.build import build_group
from retiarii.optim.cse import cse
from retiarii.optim.plan import PlanModel, Role, build_plan

from test_optim_cse import _swap  # a trial's RNG streams swapped in, as TrialRun does

# Batched calls are bit-identical to calls alone for every operator measured on this CPU
# (linears, convolutions, LayerNorm, pooling, activations), but a kernel may block a larger
# batch differently: the tests allow the float32 rounding of one reordered sum.
TOL = {"rtol": 1e-5, "atol": 1e-6}


class Trunk(nn.Module):
    """A frozen backbone with an adapter slot (an identity) after each layer."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.slots = nn.ModuleList(nn.Identity() for _ in layers)
        self.head = nn.Linear(6, 2)
        for layer in self.layers:
            layer.requires_grad_(False)

    def forward(self, x):
        for layer, slot in zip(self.layers, self.slots):
            x = slot(layer(x))
        return self.head(x)


def adapter():
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))  # (B, 6) -> (B, 6)


def trunk_space(layers, trainable=()):
    torch.manual_seed(0)
    mutators = [rt.apply_mutator(f"slots.{d}", rt.mutators.OperatorMutator(
        {"id": nn.Identity(), "ad": adapter()}, label=f"s{d}")) for d in range(len(layers))]
    base = Trunk(layers)
    for d in trainable:
        base.layers[d].requires_grad_(True)
    return rt.ModelSpace(base, mutators, example_input=torch.randn(3, 6))


def sample_at(depth, n):
    """An adapter in slot ``depth`` (None: no adapter)."""
    return {f"s{d}/slots.{d}": "ad" if d == depth else "id" for d in range(n)}


def plan_of(space, samples, data_key="d"):
    return build_plan([PlanModel(f"t{i}", space.replay(s), data_key)
                       for i, s in enumerate(samples)])


def linears(n):
    return [nn.Linear(6, 6) for _ in range(n)]


def test_adapters_at_different_depths_batch_the_frozen_layers_after_them():
    space = trunk_space(linears(3))
    plan = plan_of(space, [sample_at(0, 3), sample_at(1, 3)])
    # x, 3 layers, 3 slots, head, output: 9 nodes per model
    assert plan.executions() == 18
    after_cse = cse(plan).plan
    assert after_cse.executions() == 16  # x and layers.0 once
    result = batching(after_cse)
    assert result.modified
    # layers.1 and layers.2: one call each for both models (the identities are not batched)
    assert result.plan.executions() == 14
    assert sorted(result.plan.nodes[k].name for b in result.plan.batches for _, k in b[:1]) \
        == ["layers.1", "layers.2"]
    assert all([t for t, _ in b] == ["t0", "t1"] for b in result.plan.batches)


def test_counting_with_n_models_and_a_common_prefix():
    space = trunk_space(linears(4))
    samples = [sample_at(d, 4) for d in (1, 2, 3, 1)]
    plan = batching(cse(plan_of(space, samples)).plan).plan
    # CSE shares x, layers.0, slots.0, layers.1 and, for t1 and t2 (no adapter yet), slots.1
    # and layers.2. layers.2 then has three values: t0's, the shared one, t3's (t0 and t3 are
    # one architecture, but an adapter trains: its output is each model's own). A key CSE
    # computes once is not batched: layers.2 is one call for t0 and t3 (2 -> 1); layers.3
    # has four different inputs, one call (4 -> 1).
    batched = {plan.nodes[k].name: len(b) for b in plan.batches for _, k in b[:1]}
    assert batched == {"layers.2": 2, "layers.3": 4}
    assert plan.executions() == cse(plan_of(space, samples)).plan.executions() - 1 - 3


def test_idempotent_and_modified_honest():
    space = trunk_space(linears(3))
    plan = cse(plan_of(space, [sample_at(0, 3), sample_at(2, 3)])).plan
    once = batching(plan)
    twice = batching(once.plan)
    assert once.modified and not twice.modified and twice.plan is once.plan
    assert cse(once.plan).modified is False  # CSE leaves batched keys alone
    frozen = cse(plan_of(space, [sample_at(-1, 3)] * 3)).plan  # no adapter: CSE shares all
    assert batching(frozen).modified is False
    # one architecture, two trials: each adapter trains, so the layers after it are batched
    assert len(batching(cse(plan_of(space, [sample_at(1, 3)] * 2)).plan).plan.batches) == 1


@pytest.mark.parametrize("layer,trains", [
    (lambda: nn.BatchNorm1d(6), False),  # frozen, but train mode mixes the examples
    (lambda: nn.Dropout(0.5), False),  # random
    (lambda: nn.Linear(6, 6), True),  # trainable
])
def test_never_batched(layer, trains):
    space = trunk_space([nn.Linear(6, 6), layer(), nn.Linear(6, 6)], trainable=(1,) if trains else ())
    plan = batching(cse(plan_of(space, [sample_at(0, 3), sample_at(2, 3)])).plan).plan
    names = {plan.nodes[k].name for b in plan.batches for _, k in b}
    assert "layers.1" not in names
    node = plan.nodes[plan.keys["t0"][plan.model("t0").model.graph["layers.1"].uid]]
    if isinstance(layer(), nn.BatchNorm1d):  # frozen with running statistics: shared by CSE
        assert node.role is Role.FROZEN and node.stateful  # when fed one value, never batched
    else:
        assert node.role is Role.OWN


def test_batch_independence_rule():
    assert batch_independent(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2)))
    assert batch_independent(nn.Flatten(1)) and not batch_independent(nn.Flatten(0))
    assert batch_independent(nn.Softmax(-1)) and not batch_independent(nn.Softmax(0))
    for bad in (nn.BatchNorm2d(4), nn.Dropout(0.1), nn.InstanceNorm1d(4, track_running_stats=True),
                nn.MultiheadAttention(4, 1), nn.LSTM(4, 4)):
        assert not batch_independent(bad), bad


def test_restrict_keeps_batches_of_the_subset():
    space = trunk_space(linears(3))
    plan = batching(cse(plan_of(space, [sample_at(0, 3), sample_at(1, 3), sample_at(0, 3)]))
                    .plan).plan
    sub = plan.restrict(["t0", "t1"])
    assert [[t for t, _ in b] for b in sub.batches] == [["t0", "t1"], ["t0", "t1"]]
    assert plan.restrict(["t0"]).batches == ()


# ---- fuzz: random frozen trunks, adapters in random slots; reference: each model alone ------

TRUNK = {"lin": lambda: nn.Linear(6, 6), "ln": lambda: nn.LayerNorm(6), "relu": nn.ReLU,
         "relu_": lambda: nn.ReLU(inplace=True), "gelu": nn.GELU,
         "drop": lambda: nn.Dropout(0.3), "bn": lambda: nn.BatchNorm1d(6)}


@st.composite
def programs(draw):
    layers = draw(st.lists(st.sampled_from(sorted(TRUNK)), min_size=2, max_size=6))
    n = draw(st.integers(2, 5))
    depths = draw(st.lists(st.integers(-1, len(layers) - 1), min_size=n, max_size=n))
    return layers, depths, draw(st.booleans())


def _alone(model, x, seed):
    ckpt.seed_rng(seed)
    return model(x)


@settings(max_examples=25, deadline=None)
@given(programs())
def test_fuzz_batching_is_sound(program):
    layers, depths, train = program
    torch.manual_seed(0)
    space = trunk_space([TRUNK[name]() for name in layers])
    samples = [sample_at(d, len(layers)) for d in depths]
    plan = cse(plan_of(space, samples)).plan
    result = batching(plan)
    assert result.modified == (result.plan.batches != plan.batches)
    assert batching(result.plan).modified is False
    assert result.plan.executions() <= plan.executions()
    for batch in result.plan.batches:
        assert len({t for t, _ in batch}) == len(batch) > 1
        assert len({result.plan.nodes[k].op_key for _, k in batch}) == 1
        assert all(result.plan.nodes[k].role is not Role.OWN for _, k in batch)
    group = tuple(m.trial_id for m in result.plan.models)
    built = {t: space.build(s, check=False) for t, s in zip(group, samples)}
    alone = {t: copy.deepcopy(m).train(train) for t, m in built.items()}
    x = torch.randn(4, 6)
    expected = {t: _alone(alone[t], x.clone(), seed=i) for i, t in enumerate(group)}
    try:
        for t in group:
            expected[t].square().sum().backward()
    except RuntimeError:  # relu -> relu_ writes what ReLU's backward reads: invalid alone too
        assume(False)
    states = {}
    for i, t in enumerate(group):
        ckpt.seed_rng(i)
        states[t] = ckpt.native_rng()
    module = build_group(result.plan, built).train(train)
    module.graph.lint()
    got = module(x.clone(), rng={t: _swap(states, t) for t in group})
    sum(got[t].square().sum() for t in group).backward()
    for t in group:
        torch.testing.assert_close(got[t], expected[t], **TOL)
        for (name, p), q in zip(built[t].named_parameters(), alone[t].parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:  # a bias before a train-mode BatchNorm has a gradient of
                # 0 in exact arithmetic: float32 leaves the noise of the terms it sums (~1e-6),
                # which two summation orders (AVX-512 kernels batch otherwise) do not share
                torch.testing.assert_close(p.grad, q.grad, rtol=TOL["rtol"], atol=1e-5)


# ---- training: N models through the group equal each trained alone --------------------------

def test_training_through_batched_frozen_layers_equals_training_alone():
    """Adapters *before* frozen layers: the gradient reaches them through the batched call."""
    space = trunk_space([nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6), nn.LayerNorm(6)])
    samples = [sample_at(d, 4) for d in (0, 1, 2, 3, -1)]
    plan = batching(cse(plan_of(space, samples)).plan).plan
    assert plan.batches  # layers.2 and layers.3 (and the ReLU) run batched
    trials = [m.trial_id for m in plan.models]
    models = {}
    for i, (t, s) in enumerate(zip(trials, samples)):
        torch.manual_seed(10 + i)
        models[t] = space.build(s, check=False)
    alone = {t: copy.deepcopy(m) for t, m in models.items()}
    group = build_group(plan, models)
    g = group.graph  # the IR: each batch as cat -> the operator's cell -> split
    g.lint()
    assert rt.Graph.from_json(g.to_json()).to_json() == g.to_json()
    assert {n.name for n in g.nodes if n.name.startswith("batch_") and n.kind == "subgraph"} \
        == {f"batch_{b}" for b in range(len(group._batches))}  # one per region (regions.py)
    assert sum(b.operators for b in group._batches) == len(plan.batches)
    opts = {t: torch.optim.SGD(m.parameters(), lr=0.05 * (1 + i), momentum=0.9)
            for i, (t, m) in enumerate(models.items())}
    alone_opts = {t: torch.optim.SGD(m.parameters(), lr=0.05 * (1 + i), momentum=0.9)
                  for i, (t, m) in enumerate(alone.items())}
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 2, (16,), generator=gen)
        outs = group(x)
        losses = {t: F.cross_entropy(outs[t], y) for t in trials}
        for opt in opts.values():
            opt.zero_grad()
        sum(losses.values()).backward()
        for t in trials:
            opts[t].step()
            alone_opts[t].zero_grad()
            loss = F.cross_entropy(alone[t](x), y)
            loss.backward()
            alone_opts[t].step()
            torch.testing.assert_close(losses[t], loss, **TOL)
    for t in trials:
        for (name, p), q in zip(models[t].state_dict().items(), alone[t].state_dict().values()):
            torch.testing.assert_close(p, q, **TOL, msg=name)
        adapters = [p for n, p in models[t].named_parameters() if n.startswith("slots")]
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters)
        frozen = [p for n, p in models[t].named_parameters() if n.startswith("layers")]
        assert all(p.grad is None for p in frozen)


class InPlace(nn.Module):
    """A frozen block that starts with an in-place ReLU, once on a value read again (the
    residual) and once on a value nothing else reads."""

    def __init__(self):
        super().__init__()
        self.slot = nn.Identity()
        self.a = nn.Linear(6, 6)
        self.b = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(6, 6))
        self.c = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(6, 6))
        self.head = nn.Linear(6, 2)
        for m in (self.a, self.b, self.c):
            m.requires_grad_(False)

    def forward(self, x):
        h = self.a(self.slot(x))
        return self.head(self.c(self.b(h) + h))  # alone, b's ReLU writes h: the add reads it


def test_in_place_operators_are_batched_only_where_no_one_else_reads_their_input():
    torch.manual_seed(0)
    space = rt.ModelSpace(InPlace(), [rt.apply_mutator("slot", rt.mutators.OperatorMutator(
        {"id": nn.Identity(), "ad": adapter()}, label="s"))], example_input=torch.randn(3, 6))
    samples = [{"s/slot": "ad"}] * 3
    plan = batching(cse(plan_of(space, samples)).plan).plan
    names = {plan.nodes[k].name for b in plan.batches for _, k in b}
    # fx flattens the Sequentials: b.0 writes h, which the add reads again: not batched, nor
    # is a, whose output b.0 writes; c.0 writes the add's output, read by nothing else:
    # batched, as are the linears after them
    assert names == {"b.1", "c.0", "c.1"}
    built = {t: space.build(s, check=False) for t, s in zip(("t0", "t1", "t2"), samples)}
    alone = {t: copy.deepcopy(m) for t, m in built.items()}
    x = torch.randn(5, 6)
    got = build_group(plan, built)(x.clone())
    for t in built:
        torch.testing.assert_close(got[t], alone[t](x.clone()), **TOL)
