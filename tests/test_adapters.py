"""Adapters on a frozen MobileNetV2 (model_spaces/adapters.py, paper Fig. 14), batched.

The reference is each model trained alone: the same losses at every step and the same
weights after 20 SGD steps, through the grouped-job planning path (``plan_group`` with
batching) and the group executable, including a model stopped in the middle (the group is
rebuilt over the others, as ``TrainingGroup.drop`` does). Also the batching of two-input
element-wise functions (MobileNetV2's residual adds) on its own, and the benchmark's smoke run.
"""
from __future__ import annotations

import copy
import doctest
import importlib.util
import os
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import retiarii as rt
from model_spaces import adapters
from retiarii.engine.worker_side.group_candidates import plan_group
from retiarii.optim.batching import batching
from retiarii.optim.build import build_group
from retiarii.optim.group_module import _call
from retiarii.optim.cse import cse
from retiarii.optim.plan import PlanModel, build_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Batched kernels may round a sum in another order: float32 rounding, after 20 steps.
TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def space():
    return adapters.small()


def _adapter_and_head(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_the_space_chooses_the_block_and_trains_only_the_adapter_and_the_head(space):
    assert space.size() == 5
    for block in range(5):
        model = space.build({"block": block}, check=False)
        trainable = sorted(_adapter_and_head(model))
        assert len(trainable) == 4 and trainable[-2:] == ["fc.bias", "fc.weight"]
        assert all("adapter" in n for n in trainable[:2])
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        assert model(torch.randn(3, 3, 16, 16)).shape == (3, 10)


def test_frozen_blocks_and_residual_adds_are_batched(space):
    samples = [{"block": b} for b in (0, 2, 4, 1)]
    plan = plan_group({f"t{i}": space.replay(s) for i, s in enumerate(samples)}, "d",
                      {f"t{i}": {} for i in range(4)}, batch_ops=True)
    kinds = {}
    for batch in plan.batches:
        name = plan.nodes[batch[0][1]].name
        kinds[name.rsplit(".", 1)[-1].split("_")[0]] = True
    assert "add" in kinds  # the residual connections
    names = {plan.nodes[b[0][1]].name for b in plan.batches}
    assert any(n.endswith(".1") for n in names)  # FrozenBatchNorm after a conv
    separate = build_plan([PlanModel(f"t{i}", space.replay(s), "d")
                           for i, s in enumerate(samples)]).executions()
    only_cse = cse(build_plan([PlanModel(f"t{i}", space.replay(s), "d")
                               for i, s in enumerate(samples)])).plan.executions()
    assert plan.executions() < only_cse < separate
    # regions.py: chains of batched operators over the same models run as one call each
    group = build_group(plan, {f"t{i}": space.build(s, check=False)
                               for i, s in enumerate(samples)})
    assert len(group._batches) < len(plan.batches)
    assert sum(b.operators for b in group._batches) == len(plan.batches)
    assert max(b.operators for b in group._batches) > 1
    group.graph.lint()
    assert rt.Graph.from_json(group.graph.to_json()).to_json() == group.graph.to_json()


def test_emitted_cells_call_their_modules_by_flat_names_and_copy_and_move(space):
    """cell_emit._direct_calls: the nested MobileNetV2 modules are called by one flat name (no
    ``getattr`` chains in the code), which neither the state dict nor ``modules()`` lists; a
    deep copy and a dtype move compute what the original does."""
    samples = [{"block": b} for b in (0, 2, 4)]
    plan = plan_group({f"t{i}": space.replay(s) for i, s in enumerate(samples)}, "d",
                      {f"t{i}": {} for i in range(3)}, batch_ops=True)
    group = build_group(plan, {f"t{i}": space.build(s, check=False)
                               for i, s in enumerate(samples)})
    cells = [b.module for b in group._batches] + [c.module for c in group._cells]
    assert any("self._call_backbone_layers_" in m.code for m in cells)
    for m in cells:
        assert "getattr(" not in m.code
        assert not any("_call_" in k for k in m.state_dict())
        assert not any("_call_" in n for n, _ in m.named_modules())
    x = torch.randn(2, 3, 16, 16)
    before = group(x)
    twin = copy.deepcopy(group)
    assert all(torch.equal(twin(x)[t], before[t]) for t in before)
    group.double()  # moves tensors, keeps the module objects the flat names point at
    after = group(x.double())
    for t in before:
        torch.testing.assert_close(after[t].float(), before[t], rtol=1e-5, atol=1e-6)


def _train(space, samples, steps, stop=None):
    """Train the models separately and as one batched group on the same batches; ``stop``:
    (trial, step) after which that trial leaves the group. Returns per trial the losses and
    trainable values, separate and grouped."""
    trials = [f"t{i}" for i in range(len(samples))]
    models = {}
    for i, (t, s) in enumerate(zip(trials, samples)):
        torch.manual_seed(100 + i)  # each model's own adapter and head
        models[t] = space.build(s, check=False)
    alone = {t: copy.deepcopy(m) for t, m in models.items()}
    initial = {t: _adapter_and_head(m) for t, m in models.items()}
    lr = {t: 0.05 * (1 + i) for i, t in enumerate(trials)}  # per-model learning rates
    opts = {t: torch.optim.SGD(m.parameters(), lr=lr[t], momentum=0.9) for t, m in models.items()}
    alone_opts = {t: torch.optim.SGD(m.parameters(), lr=lr[t], momentum=0.9)
                  for t, m in alone.items()}
    plan = plan_group({t: space.replay(s) for t, s in zip(trials, samples)}, "d",
                      {t: {} for t in trials}, batch_ops=True)
    assert plan.batches
    live = list(trials)
    group = build_group(plan.restrict(live), {t: models[t] for t in live})
    gen = torch.Generator().manual_seed(0)
    losses = {t: ([], []) for t in trials}
    for step in range(steps):
        x, y = torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 10, (4,), generator=gen)
        outs = group(x)
        step_losses = {t: F.cross_entropy(outs[t], y) for t in live}
        for t in live:
            opts[t].zero_grad()
        sum(step_losses.values()).backward()
        for t in live:
            opts[t].step()
            alone_opts[t].zero_grad()
            loss = F.cross_entropy(alone[t](x), y)
            loss.backward()
            alone_opts[t].step()
            losses[t][0].append(loss.item())
            losses[t][1].append(step_losses[t].item())
        if stop is not None and step == stop[1]:
            live.remove(stop[0])  # what TrainingGroup.drop does: rebuild over the others
            group = build_group(plan.restrict(live), {t: models[t] for t in live})
    return {t: (losses[t], _adapter_and_head(alone[t]), _adapter_and_head(models[t]),
                initial[t]) for t in trials}


@pytest.mark.parametrize("stop", [None, ("t2", 9)])
def test_batched_training_equals_separate_training(space, stop):
    """20 steps, five models (adapters after blocks 0, 3, 1, 4 and 1 again), own learning
    rates: every loss and the adapter and head weights within 1e-5 relative (measured on this
    CPU: equal, or a few float32 ulps); a model stopped after step 10 keeps what it had."""
    samples = [{"block": b} for b in (0, 3, 1, 4, 1)]
    results = _train(space, samples, 20, stop)
    for t, ((alone_losses, grouped_losses), alone_w, grouped_w, initial) in results.items():
        expected_steps = 10 if stop and t == stop[0] else 20
        assert len(grouped_losses) == len(alone_losses) == expected_steps
        torch.testing.assert_close(torch.tensor(grouped_losses), torch.tensor(alone_losses),
                                   **TOL)
        assert alone_w.keys() == grouped_w.keys() and len(alone_w) == 4
        for name in alone_w:
            torch.testing.assert_close(grouped_w[name], alone_w[name], **TOL, msg=name)
            assert not torch.equal(grouped_w[name], initial[name])  # it did train


class Residual(nn.Module):
    """A frozen trunk of residual blocks ``x + lin(x)`` with an adapter slot after each, one
    block adding a broadcast operand ``(1, 6)``, one ``torch.add`` with ``alpha``."""

    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.slots = nn.ModuleList(nn.Identity() for _ in range(4))
        self.head = nn.Linear(6, 2)
        self.lins.requires_grad_(False)

    def forward(self, x):
        x = self.slots[0](x + self.lins[0](x))
        x = self.slots[1](x + self.lins[1](x))
        x = self.slots[2](x + self.lins[2](x).mean(0, keepdim=True))  # broadcast: (B,6)+(1,6)
        x = self.slots[3](torch.add(x, self.lins[3](x), alpha=0.5))  # a keyword: never batched
        return self.head(x)


def _residual_space():
    torch.manual_seed(0)
    adapter = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
    return rt.ModelSpace(Residual(), [rt.apply_mutator(f"slots.{d}", rt.mutators.OperatorMutator(
        {"id": nn.Identity(), "ad": adapter}, label=f"s{d}")) for d in range(4)],
        example_input=torch.randn(3, 6))


def test_two_input_element_wise_functions_batch_and_equal_each_model_alone():
    space = _residual_space()
    samples = [{f"s{d}/slots.{d}": "ad" if d == at else "id" for d in range(4)}
               for at in (0, 0, 1)]
    trials = ["a", "b", "c"]
    plan = batching(cse(build_plan([PlanModel(t, space.replay(s), "d")
                                    for t, s in zip(trials, samples)])).plan).plan
    assert batching(plan).modified is False  # idempotent with functions batched too
    batched = {plan.nodes[b[0][1]].name for b in plan.batches}
    assert "add_1" in batched  # x + lins[1](x) of models a and b: one call
    assert "add_2" in batched  # + a (1, 6) operand: planned, but runs per model (shapes)
    assert "add_3" not in batched and "lins.3" in batched  # torch.add(alpha=): never
    models = {}
    for i, (t, s) in enumerate(zip(trials, samples)):
        torch.manual_seed(10 + i)
        models[t] = space.build(s, check=False)
    alone = {t: copy.deepcopy(m) for t, m in models.items()}
    group = build_group(plan, models)
    group.graph.lint()
    x = torch.randn(5, 6)
    outs = group(x)
    sum(outs[t].square().sum() for t in trials).backward()
    for t in trials:
        expected = alone[t](x)
        expected.square().sum().backward()
        torch.testing.assert_close(outs[t], expected, **TOL)
        for (name, p), q in zip(models[t].named_parameters(), alone[t].parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


def test_batched_add_gradcheck():
    """A batched residual add (concatenate each operand, one add, split) passes each model's
    gradient back to its own operands: float64 gradcheck of the batched call. Since batched
    operators in a chain run as one region (regions.py), ``x + lin(x)`` is one call."""
    space = _residual_space()
    samples = [{f"s{d}/slots.{d}": "ad" if d == 0 else "id" for d in range(4)}] * 2
    plan = batching(cse(build_plan([PlanModel(t, space.replay(s), "d")
                                    for t, s in zip("ab", samples)])).plan).plan
    group = build_group(plan, {t: space.build(s, check=False) for t, s in zip("ab", samples)})
    region = next(b for b in group._batches  # x -> lins.1 -> + x: the region of add_1
                  if any(n.kind == "function" and n.op.target == "_operator:add"
                         for n in b.graph.nodes) and b.operators == 2)
    lin = region.module.get_submodule("lins.1").double()
    xs = [torch.randn(n, 6, dtype=torch.float64, requires_grad=True) for n in (3, 2)]

    def batched(x0, x1):  # models 0 and 1: x_i + lin(x_i), as one call
        return tuple(y for (y,) in _call(region, [[x0], [x1]], [[True]] * 2, {}))

    assert torch.autograd.gradcheck(batched, xs)
    outs = batched(*xs)
    for out, x in zip(outs, xs):  # within float64 rounding: a matmul of 5 rows may block its
        # sums otherwise than one of 3 (AVX-512 kernels do), so exact equality is the CPU's
        torch.testing.assert_close(out, x + lin(x), rtol=1e-12, atol=1e-12)

    add = next(b for b in group._batches  # add_2: two operands from outside the region
               if any(n.name == "add_2" for n in b.graph.nodes))
    ops = [torch.randn(n, 6, dtype=torch.float64, requires_grad=True) for n in (3, 3, 2, 2)]

    def two(a0, b0, a1, b1):
        return tuple(y for (y,) in _call(add, [[a0, b0], [a1, b1]], [[True, True]] * 2, {}))

    assert torch.autograd.gradcheck(two, ops)
    outs = two(*ops)
    torch.testing.assert_close(outs[0], ops[0] + ops[1], rtol=0, atol=0)
    torch.testing.assert_close(outs[1], ops[2] + ops[3], rtol=0, atol=0)


def test_docstring_examples_run():
    result = doctest.testmod(adapters)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.slow  # about 5 s of CPU, 15-25 s on the shared machine
def test_benchmark_quick_runs(tmp_path, capsys):
    """benchmarks/adapters.py --quick, in this process."""
    spec = importlib.util.spec_from_file_location(
        "adapters_benchmark", os.path.join(ROOT, "benchmarks", "adapters.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # its _out helper
    try:
        spec.loader.exec_module(bench)
        threads = torch.get_num_threads()
        bench.main(["--quick", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    out = capsys.readouterr().out
    assert "N=  2" in out and "N=  4" in out and "cse+batching" in out
    assert (tmp_path / "adapters-cpu-quick.csv").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batched_group_on_a_gpu_equals_each_model_alone(space):
    """On the GPU: the batched group's outputs and the adapters' and heads' gradients equal
    each model's alone within rtol 1e-4 (cuDNN may pick other kernels for a larger batch).
    TF32 is off for the comparison: with it (cuDNN's default for convolutions on an H100) a
    kernel chosen for another batch size differs by ~1e-3 relative, alone or batched."""
    device = torch.device("cuda")
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        _compare_on_gpu(space, device)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


def _compare_on_gpu(space, device):
    samples = [{"block": b} for b in (0, 3, 1, 4)]
    trials = [f"t{i}" for i in range(len(samples))]
    models = {}
    for i, (t, s) in enumerate(zip(trials, samples)):
        torch.manual_seed(100 + i)
        models[t] = space.build(s, check=False).to(device)
    alone = {t: copy.deepcopy(m) for t, m in models.items()}
    plan = plan_group({t: space.replay(s) for t, s in zip(trials, samples)}, "d",
                      {t: {} for t in trials}, batch_ops=True)
    group = build_group(plan, models)
    x = torch.randn(4, 3, 16, 16, device=device)
    outs = group(x)
    sum(outs[t].square().sum() for t in trials).backward()
    for t in trials:
        expected = alone[t](x)
        expected.square().sum().backward()
        torch.testing.assert_close(outs[t], expected, rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(models[t].named_parameters(), alone[t].parameters()):
            if p.requires_grad:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
