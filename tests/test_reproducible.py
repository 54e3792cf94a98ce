"""The default search is reproducible (issue #26 item 3): what changes values is not timed.

Fusing models computes their values with other kernels (other float rounding), so under the
default (``optimize="auto"``, ``fuse="auto"``, ``batching="auto"``) the device model
(``retiarii/optim/device_model.py``) decides it from the models' shapes; time chooses only
between a model apart and in a CSE group, which train it bit for bit alike. Here the
worker's clock is replaced by a random one (each run its own): two runs of one seeded
search still give every model the same metrics at every step, bit for bit, and the plans
table says what the device model predicted.
"""
from __future__ import annotations

import random
import re
import time
import types

import pytest
import torch
from torch import fx, nn

import retiarii as rt
from retiarii.cli_inspect import optimization_line
from retiarii.engine.storage.plans_table import PlanTable
from retiarii.engine.storage.store import Store
import test_optimize as o
from engine_helpers import InProcessExecutor
from exp_space import lr_trainer, mlp_space
from retiarii.engine.worker_side import compute_clock as clock, group_layouts as layouts, worker
from retiarii.engine.worker_side import training_group as grouped
from retiarii.optim import device_model as dm


def _random_clock(monkeypatch, seed):
    """Every measurement of the worker reads a clock that runs at random speeds."""
    rng = random.Random(seed)
    now = [0.0]

    def perf_counter():
        now[0] += rng.uniform(1e-5, 0.5)
        return now[0]
    fake = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time)
                                    if not n.startswith("__")})
    fake.perf_counter = fake.process_time = perf_counter
    for module in (clock, grouped, layouts, worker):  # measuring_group reads clock's
        monkeypatch.setattr(module, "time", fake)


def _search(tmp_path, name, **kw):
    db = tmp_path / f"{name}.db"
    exp = rt.Experiment(mlp_space, rt.strategies.GridSearch(), lr_trainer, store=str(db),
                        executor=InProcessExecutor(), seed=0, max_models=4, **kw)
    exp.run()
    return db


def test_two_runs_of_the_default_are_bit_identical_whatever_the_timings(tmp_path, monkeypatch):
    runs = []
    for seed in (1, 2):
        with monkeypatch.context() as m:
            _random_clock(m, seed)
            runs.append(_search(tmp_path, f"auto{seed}"))
    first, second = (o._curves(db) for db in runs)
    assert len(first) == 4 and first == second
    # the device model fused the four learning rates of one small MLP (and said so)
    units = [u for r in o._plans(runs[0]) for u in r["units"]]
    assert any(u.get("fused") for u in units)
    predicted = [line for u in units for line in (u.get("choice") or {}).get("predicted", ())]
    assert predicted and all("predicted" in line and "fused" in line for line in predicted)
    with Store(runs[0]) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        line = optimization_line(PlanTable(store).summary())
    assert "fusion by the device model, cpu: 4 models: predicted" in line
    # fused values are separate training's within the fused tolerance
    off = o._curves(_search(tmp_path, "off", optimize=False))
    for key, (state, curves) in off.items():
        for name, points in curves.items():
            got = first[key][1][name]
            assert [s for s, _ in got] == [s for s, _ in points]
            assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-4)


def test_a_model_the_device_model_does_not_fuse_trains_bit_for_bit_as_alone(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setattr(dm, "FUSE_MARGIN", 1e9)  # nothing is predicted fast enough
    with monkeypatch.context() as m:
        _random_clock(m, 3)
        auto = o._curves(_search(tmp_path, "auto"))
    assert auto == o._curves(_search(tmp_path, "off", optimize=False))


def _mlp(width):
    return fx.symbolic_trace(nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width),
                                           nn.ReLU(), nn.Linear(width, 10)))


def test_the_device_model_fuses_narrow_layers_and_not_wide_ones_on_a_cpu(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    x = torch.zeros(128, 64)
    narrow, wide = dm.step_costs(_mlp(64), [x]), dm.step_costs(_mlp(512), [x])
    assert narrow.flops == 2 * 128 * (64 * 64 + 64 * 64 + 64 * 10)  # by hand
    assert len(narrow.ops) == 5 and narrow.frozen_flops == 0
    # measured (benchmarks/README.md): 16 fused 2.5x at width 64, 0.61x at 512 (4 models)
    assert dm.predicted_fused_speedup([narrow] * 16, "cpu") >= dm.FUSE_MARGIN
    assert dm.predicted_fused_speedup([wide] * 4, "cpu") < dm.FUSE_MARGIN
    assert dm.predicted_fused_speedup([wide] * 4, "cuda") >= dm.FUSE_MARGIN
    # the same costs give the same figure: a decision, not a measurement
    assert dm.predicted_fused_speedup([narrow] * 8, "cpu") == dm.predicted_fused_speedup(
        [narrow] * 8, "cpu")
    assert dm.predicted_fused_speedup([narrow], "cpu") == 1.0


class _WholeBatch(nn.Module):
    """Needs the whole batch of 8 (a hard-coded view): the probe on 2 examples fails."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x.view(8, 4))


def test_the_probe_forward_counts_what_the_meta_forward_counts(monkeypatch):
    """step_costs runs the real model on 2 examples (zeros where the worker recorded meta
    tensors), its FLOPs scaled to the batch, several times sooner than a forward on meta
    tensors; it counts the same, and a model the probe cannot run is counted on meta."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten())
    trunk.requires_grad_(False)
    models = [fx.symbolic_trace(nn.Sequential(trunk, nn.Dropout(0.3), nn.Linear(144, 2))),
              fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))),
              _WholeBatch()]
    inputs = [torch.randn(16, 3, 8, 8), torch.randn(16, 8), torch.randn(8, 4)]
    probe = dm._probe_forward
    for model, x in zip(models, inputs):
        fast, on_meta = dm.step_costs(model, [x]), dm.step_costs(model, [x.to("meta")])
        monkeypatch.setattr(dm, "_probe_forward", lambda *a: None)
        want = dm.step_costs(model, [x])
        monkeypatch.setattr(dm, "_probe_forward", probe)
        assert fast == on_meta == want
    assert models[0].get_submodule("0.1").running_mean.abs().sum() == 0  # never moved

    class Counting(nn.Module):  # a forward with a side effect: it lands on the probe's copy
        def __init__(self):
            super().__init__()
            self.fc, self.calls = nn.Linear(4, 2), 0

        def forward(self, x):
            self.calls += 1
            return self.fc(x)

    counting = Counting()
    assert dm.step_costs(counting, [torch.randn(8, 4)]).flops == 2 * 8 * 4 * 2
    assert counting.calls == 0
    with pytest.raises(RuntimeError):  # the fallback above was taken, not a probe result
        probe(models[2], [inputs[2]])
    assert probe(models[1], [torch.zeros(()), inputs[1]]) is None  # not one batch size


def test_the_probe_copy_keeps_a_forwards_side_effects_off_the_model():
    """The probe runs on a copy of the module tree (device_model._shadow): a list a forward
    appends to and a buffer it counts in stay the model's own; the parameters are shared,
    and a GraphModule's copy is an instance of its generated class (no code regenerated)."""

    class Caching(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.seen = nn.Linear(4, 2), []
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x):
            self.seen.append(tuple(x.shape))
            self.count += 1
            return self.fc(x)

    model = Caching()
    assert dm.step_costs(model, [torch.randn(8, 4)]).flops == 2 * 8 * 4 * 2
    assert model.seen == [] and model.count.item() == 0
    traced = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    shadow = dm._shadow(traced)
    assert type(shadow) is type(traced) and shadow.code == traced.code
    mine, theirs = traced.get_submodule("1"), shadow.get_submodule("1")
    assert theirs is not mine and theirs.weight is mine.weight
    assert theirs.running_mean is not mine.running_mean
    assert torch.equal(theirs.running_mean, mine.running_mean)
    x = torch.randn(6, 4)
    shadow.train()(x)  # moves the copy's statistics only
    assert mine.running_mean.abs().sum() == 0 and theirs.running_mean.abs().sum() > 0
    assert not torch.equal(shadow.eval()(x), traced.eval()(x))  # their statistics differ


def test_step_costs_run_on_meta_tensors_and_move_nothing():
    """Neither the probe forward (train-mode BatchNorm, Dropout) nor the meta one moves a
    running statistic or draws from a random stream the trial goes on with."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    seq[0].requires_grad_(False)
    model = fx.symbolic_trace(seq)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()
    costs = dm.step_costs(model, [torch.zeros(4, 8)])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(state, torch.get_rng_state())
    assert costs.frozen_flops == 2 * 4 * 8 * 8 and costs.flops == 5 * 4 * 8 + 2 * 4 * 8 * 2
    assert costs.shared_ops == 1  # the frozen Linear; the BatchNorm after it trains


def test_a_frozen_trunk_runs_once_apart_in_the_device_model(monkeypatch):
    """The operations before a model's first trainable layer (a frozen trunk's) run once in
    a CSE group, so the device model counts them once apart: 8 heads on a frozen ResNet-18
    trunk measured 0.29x fused on an H200, where counting the trunk's 72 operations per model
    had predicted 2.8x."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    trunk = tuple(f"t{i}:Conv2d(16)" for i in range(72))
    heads = [dm.StepCosts(trunk + (f"head:Linear({w})",), 2e6 * w, 9e9, (0.0,) * 72 + (2e6 * w,),
                          40, 72) for w in range(1, 9)]
    dev = dm.DEVICES["cuda"]
    apart = sum(dev.op_s + dev.model_s + 3 * c.flops / dev.rate for c in heads) \
        + 72 * dev.op_s + 9e9 / dev.rate
    # fused: the trunk's 72 operations once each (K-model kernels, its FLOPs K times), each
    # head as alone plus its place's gather and scatter
    fused = ((72 + 2 * 8) * dev.fused_op_s + 8 * dev.fused_model_s
             + sum(dev.op_s + 3 * c.flops / dev.rate for c in heads) + 8 * 9e9 / dev.fused_rate)
    got = dm.predicted_fused_speedup(heads, "cuda")
    assert got == pytest.approx(apart / fused, rel=1e-12) and got < dm.FUSE_MARGIN
    unshared = [dm.StepCosts(c.ops, c.flops, c.frozen_flops, c.op_flops, 40, 0) for c in heads]
    assert dm.predicted_fused_speedup(unshared, "cuda") > dm.FUSE_MARGIN  # the old count
    # CSE's bound saves the prefix's operations too (K - 1 of them run for nothing apart)
    alone = sum(73 * dev.op_s + dev.model_s + (3 * c.flops + 9e9) / dev.rate for c in heads)
    assert dm.cse_bound(heads, 0.0, "cuda") == pytest.approx(
        alone / (alone - 7 * (9e9 / dev.rate + 72 * dev.op_s)), rel=1e-12)
    # only the prefix every model holds alike is shared: another first layer shares nothing
    other = dm.StepCosts(("s:Conv2d(8)",) + trunk[1:] + ("head:Linear(1)",), 2e6, 9e9,
                         (0.0,) * 72 + (2e6,), 40, 72)
    assert dm._shared_prefix([heads[0], other]) == 0
    assert dm._shared_prefix([heads[0], heads[1]]) == 72


def test_step_costs_count_a_traced_frozen_trunk_as_the_shared_prefix():
    trunk = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten())
    trunk.requires_grad_(False)
    model = fx.symbolic_trace(nn.Sequential(trunk, nn.Linear(4 * 6 * 6, 2), nn.ReLU()))
    costs = dm.step_costs(model, [torch.zeros(2, 3, 8, 8)])
    # conv, norm (frozen), relu, then the flatten, after the last frozen layer: not counted
    assert len(costs.ops) == 6 and costs.shared_ops == 2
    model.get_submodule("0.1").weight.requires_grad_(True)  # the BatchNorm trains: 1 shared
    assert dm.step_costs(model, [torch.zeros(2, 3, 8, 8)]).shared_ops == 1
    glue = fx.symbolic_trace(nn.Sequential(nn.Flatten(), nn.Linear(12, 2)))  # nothing frozen
    assert dm.step_costs(glue, [torch.zeros(2, 3, 4)]).shared_ops == 0


def test_batching_is_decided_by_the_frozen_flops_per_call():
    """(tests/test_batching_rule.py holds the hand-computed cases.)"""
    frozen = fx.symbolic_trace(nn.Sequential(nn.Linear(64, 64).requires_grad_(False),
                                             nn.Linear(64, 10)))
    small, large = (dm.step_costs(frozen, [torch.zeros(b, 64)]) for b in (32, 10**5))
    assert dm.batching_wins([small], "cpu") and not dm.batching_wins([large], "cpu")
    assert dm.batching_wins([large], "cuda:0")


def test_compute_is_timed_in_cpu_time_on_a_one_thread_cpu_worker(monkeypatch):
    """A neighbour's load on a CPU worker with one torch thread is not counted (clock.py)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert clock.compute_clock("cpu") is time.process_time
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert clock.compute_clock("cpu") is time.perf_counter
    assert clock.compute_clock(torch.device("cuda", 0)) is time.perf_counter


def test_the_cse_bound_by_hand(monkeypatch):
    """device_model.cse_bound: the frozen part once and one loader, nothing paid to group."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    cpu = dm.DEVICES["cpu"]
    own = dm.StepCosts(ops=("linear", "relu"), flops=1e6, frozen_flops=0.0)
    assert dm.cse_bound([own] * 8, 0.0, "cpu") == 1.0  # nothing to share: nothing to gain
    assert dm.cse_bound([own], 5.0, "cpu") == 1.0  # one model: no group
    # a frozen trunk of 9 GFLOP forward under each head (workload a), a 2 ms loader
    head = dm.StepCosts(ops=("linear",), flops=1e6, frozen_flops=9e9)
    alone = cpu.op_s + cpu.model_s + (3e6 + 9e9) / cpu.rate
    want = (4 * alone + 4 * 0.002) / (4 * alone - 3 * 9e9 / cpu.rate + 0.002)
    assert dm.cse_bound([head] * 4, 0.002, "cpu") == pytest.approx(want, rel=1e-12)
    assert want > 3.5 > dm.CSE_MARGIN
    # nothing frozen, but a loader (JPEG decoding) as slow as a model's step: CSE may win
    step = 2 * cpu.op_s + cpu.model_s + 3e6 / cpu.rate
    assert dm.cse_bound([own] * 8, step, "cpu") == pytest.approx(16 * step / (9 * step))
    # the smallest model's frozen part is all that every model can share
    other = dm.StepCosts(ops=("linear",), flops=1e6, frozen_flops=1e9)
    small = dm.cse_bound([head, other], 0.0, "cpu")
    both = 2 * alone - 8e9 / cpu.rate  # the second model's trunk: 1 GFLOP, not 9
    assert small == pytest.approx(both / (both - 1e9 / cpu.rate), rel=1e-12)


def test_the_cse_floor_and_the_prefix_trie_by_hand(monkeypatch):
    """device_model.cse_floor: cse_bound's savings against CSE_GROUP_COST x MODEL_S per
    model; the savings of adapters after different blocks of one frozen backbone, each block
    computed once however many models pass it (a trie of their prefixes)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    cpu = dm.DEVICES["cpu"]
    blocks = tuple(f"b{i}:Conv2d" for i in range(4))

    def adapter_after(i):  # frozen blocks 0..i, the adapter, the other blocks, a head
        ops = blocks[:i + 1] + (f"ad{i}:Linear",) + blocks[i + 1:] + ("head:Linear",)
        frozen = tuple(0.0 if o.startswith(("ad", "head")) else 1e8 for o in ops)
        flops = tuple(1e6 if o.startswith(("ad", "head")) else 0.0 for o in ops)
        return dm.StepCosts(ops, 2e6, 4e8, flops, 4, i + 1, frozen)

    models = [adapter_after(i) for i in range(4)]
    block_s = cpu.op_s + 1e8 / cpu.rate
    # prefixes of 1, 2, 3 and 4 blocks (10 computed apart), the trie holds 4: 6 saved
    assert dm._cse_saving(models, cpu, cpu.rate) == pytest.approx(6 * block_s, rel=1e-12)
    alone = 4 * (6 * cpu.op_s + cpu.model_s + (3 * 2e6 + 4e8) / cpu.rate)
    assert dm.cse_bound(models, 0.0, "cpu") == pytest.approx(alone / (alone - 6 * block_s))
    floor = dm.cse_floor(models, 0.001, "cpu")
    want = (alone + 4 * 0.001) / (alone + 4 * dm.CSE_GROUP_COST * cpu.model_s - 6 * block_s
                                  + 0.001)
    assert floor == pytest.approx(want, rel=1e-12) and floor < dm.cse_bound(models, 0.001, "cpu")
    # nothing shared: the floor is under 1 (a group only costs), one model: 1
    own = dm.StepCosts(("linear", "relu"), 1e6, 0.0, (1e6, 0.0), 0, 0, (0.0, 0.0))
    assert dm.cse_floor([own] * 8, 0.0, "cpu") < 1.0 == dm.cse_floor([own], 0.0, "cpu")
    # the demo's measured CSE (0.86-0.87x of apart) is what CSE_GROUP_COST was fitted to:
    # a small model's floor with nothing shared stays under CSE_TAKE by far
    assert dm.cse_floor([own] * 8, 0.0, "cpu") < dm.CSE_TAKE


def test_a_group_cse_cannot_pay_for_trains_apart_unmeasured_bit_for_bit(tmp_path, monkeypatch):
    """The default's group of models sharing nothing frozen, reading digits from memory: the
    device model's bound (1.00x) is under CSE_MARGIN, so the job trains them apart without
    timing a batch (the demo's first job had measured CSE at 0.86x for nothing), says so in
    the plans table, and every model trains bit for bit as unoptimized."""
    monkeypatch.setattr(dm, "FUSE_MARGIN", 1e9)  # nothing fuses: CSE or apart is the choice
    measured = []
    for name in ("_live_plans", "probe"):
        real = getattr(layouts, name)
        monkeypatch.setattr(layouts, name, lambda *a, _real=real, _name=name, **k: (
            measured.append(_name), _real(*a, **k))[1])
    sizes = []
    submit = InProcessExecutor.submit
    monkeypatch.setattr(InProcessExecutor, "submit",
                        lambda self, job: (sizes.append(len(job.tasks)), submit(self, job))[1])
    auto_db = _search(tmp_path, "auto")
    auto_jobs = list(sizes)  # this search's jobs (the lambda appends the later ones)
    assert measured == []
    assert auto_jobs == [4, 4]  # one worker: the group stays one job (nothing to balance)
    units = [u for r in o._plans(auto_db) for u in r["units"]]
    assert units and all(u["layout"] == "separate" and not u.get("merged") for u in units)
    line = [p for u in units for p in u["choice"]["predicted"] if "cse at most" in p]
    # 1.0x and the loader's timed pace (a few hundredths: bit-identical either way)
    assert line and re.fullmatch(r"4 models: cse at most 1\.0\dx \(under 1\.1x: nothing frozen "
                                 r"to share, the loader's pace\): apart, not measured", line[0])
    assert o._curves(auto_db) == o._curves(_search(tmp_path, "off", optimize=False))
    # with two workers, a decision of the device model on these models (not a measurement):
    # their later segments train alone, each to the first free worker, recorded so a resumed
    # search does too, and still bit for bit as unoptimized
    class TwoSlots(InProcessExecutor):
        num_slots = 2

    sizes.clear()
    two_db = tmp_path / "two.db"
    rt.Experiment(mlp_space, rt.strategies.GridSearch(), lr_trainer, store=str(two_db),
                  executor=TwoSlots(), seed=0, max_models=4).run()
    assert sizes == [2, 2, 1, 1, 1, 1]  # the first epoch in two groups, the second alone
    rows = o._plans(two_db)
    assert [r["status"] for r in rows] == ["not merged"] * 2
    with Store(two_db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        assert len(PlanTable(store).memory().alone) == 4
    assert o._curves(two_db) == o._curves(auto_db)
    # the bound is what spared the measurement: under a margin it passes, the group measures
    monkeypatch.setattr(dm, "CSE_MARGIN", 0.5)
    import retiarii.engine.worker_side.group_layouts as gl
    monkeypatch.setattr(gl, "CSE_MARGIN", 0.5)
    _search(tmp_path, "measured")
    assert measured
