"""Fused training of same-shape models equals training each alone (retiarii/optim/fusion.py,
fused_ops.py, fused_optim.py): losses, metrics, weights, optimizer state and checkpoints per
model within the stated tolerance, with the engine's TrialRuns too, and clear errors for what
does not fuse. Each operator against its unfused form and a fuzz test over random
architectures: tests/test_optim_fused_ops.py.

Tolerance (docs/optimization.md): after 20 steps every weight, buffer, optimizer moment and
loss of every model is within ``rtol=RTOL, atol=ATOL`` of training it alone; on CPU the fused
kernels (batched matmul, grouped convolution) round differently from the unfused ones, the
optimizers follow torch.optim's update expression by expression.
"""
import contextlib
import copy
import os
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import retiarii as rt
from retiarii.engine.storage import checkpoint as ckpt
from retiarii.optim.fused_optim import FusedOptimizer
from retiarii.optim.fusion import FusionError, fusable_groups, fuse_models, fusion_key
from retiarii.optim.fused_segments import PerModelSegment

RTOL, ATOL = 1e-5, 1e-6
K = 4
LRS = [0.05, 0.02, 0.1, 0.03]  # one learning rate per model


def mlp(dropout: float = 0.0) -> nn.Module:
    # bias=False before BatchNorm: its gradient is zero up to rounding, which Adam would
    # amplify into steps of size lr whichever way the rounding goes (alone or fused alike)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 32, bias=False),
                         nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 5))


class SmallCNN(nn.Module):
    """conv-BN-ReLU-pool twice, a residual add, global pooling, a linear head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)  # bias=False before BN, as usual
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(8 * 2 * 2, 5)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = x + F.relu(self.bn2(self.conv2(x)))
        x = F.adaptive_avg_pool2d(x, 2)
        return self.head(torch.flatten(x, 1))


DATA = {"mlp": (torch.randn(64, 12, generator=torch.Generator().manual_seed(1)),),
        "cnn": (torch.randn(32, 3, 8, 8, generator=torch.Generator().manual_seed(1)),)}
TARGETS = torch.randint(0, 5, (64,), generator=torch.Generator().manual_seed(2))


def _models(kind, n=K, dropout=0.0):
    out = []
    for k in range(n):
        torch.manual_seed(10 + k)  # each model its own init
        out.append(mlp(dropout) if kind == "mlp" else SmallCNN())
    return out


def _optimizer(name, model, k):
    lr = LRS[k]
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4 * k,
                               nesterov=k % 2 == 1)
    if name == "sgd_mixed":  # momentum 0 for one model, Nesterov for one, dampening for one
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=[0.0, 0.9, 0.5, 0.8][k],
                               nesterov=k == 2, dampening=0.1 if k == 3 else 0.0)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr / 20, betas=(0.9, 0.99 - 0.002 * k),
                                weight_decay=1e-4 * k)
    return torch.optim.AdamW(model.parameters(), lr=lr / 20, weight_decay=0.01 * k)


def _scheduler(opt, k):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=5 + k, gamma=0.5)


def _batches(kind, steps, start=0):
    x = DATA[kind][0]
    n = x.shape[0]
    for s in range(start, start + steps):
        idx = torch.arange(s * 16, s * 16 + 16) % n
        yield x[idx], TARGETS[:n][idx]


class _Streams:
    """Each model's own torch RNG stream (what TrialRun._own_rng does for a trial)."""

    def __init__(self, seeds):
        self.states = []
        for s in seeds:
            g = torch.Generator().manual_seed(s)
            self.states.append(g.get_state())

    @contextlib.contextmanager
    def use(self, k):
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states[k])
        try:
            yield
        finally:
            self.states[k] = torch.get_rng_state()
            torch.set_rng_state(outer)

    def contexts(self):
        return [lambda k=k: self.use(k) for k in range(len(self.states))]


def _train_alone(kind, opt_name, steps, models=None, dropout=0.0, states=None, start=0):
    models = models or _models(kind, dropout=dropout)
    opts = [_optimizer(opt_name, m, k) for k, m in enumerate(models)]
    scheds = [_scheduler(o, k) for k, o in enumerate(opts)]
    if states is not None:
        for k in range(len(models)):
            models[k].load_state_dict(states[k]["model"])
            opts[k].load_state_dict(states[k]["optimizer"])
            scheds[k].load_state_dict(states[k]["scheduler"])
    streams = _Streams(range(100, 100 + len(models)))
    losses = [[] for _ in models]
    for k, (model, opt, sched) in enumerate(zip(models, opts, scheds)):
        model.train()
        for x, y in _batches(kind, steps, start):
            with streams.use(k):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses[k].append(loss.item())
    return models, opts, scheds, losses


def _train_fused(kind, opt_name, steps, models=None, dropout=0.0, states=None, start=0):
    models = models or _models(kind, dropout=dropout)
    opts = [_optimizer(opt_name, m, k) for k, m in enumerate(models)]
    scheds = [_scheduler(o, k) for k, o in enumerate(opts)]
    if states is not None:  # per-model checkpoints, loaded before fusing
        for k in range(len(models)):
            models[k].load_state_dict(states[k]["model"])
            opts[k].load_state_dict(states[k]["optimizer"])
            scheds[k].load_state_dict(states[k]["scheduler"])
    fused = fuse_models(models)
    fopt = FusedOptimizer(fused, opts)
    streams = _Streams(range(100, 100 + len(models)))
    losses = [[] for _ in models]
    fused.train()
    for x, y in _batches(kind, steps, start):
        out = fused(x, rng=streams.contexts())  # (K, B, classes)
        per = [F.cross_entropy(out[k], y) for k in range(len(models))]
        fopt.zero_grad()
        sum(per).backward()
        fopt.step()
        for s in scheds:
            s.step()
        for k, loss in enumerate(per):
            losses[k].append(loss.item())
    return models, opts, scheds, losses, fused, fopt


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _same_state(a, b, what):
    """Two state dicts with the same keys, order, shapes and dtypes, values within tolerance."""
    if isinstance(a, dict):
        assert list(a) == list(b), f"{what}: keys {list(a)} != {list(b)}"
        for key in a:
            _same_state(a[key], b[key], f"{what}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _same_state(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {b.shape}"
        _close(a.double(), b.double(), what)
    else:
        assert a == b, f"{what}: {a} != {b}"


def _eval_metrics(model_or_fused, kind, fused=False):
    x = DATA[kind][0]
    y = TARGETS[: x.shape[0]]
    with torch.no_grad():
        model_or_fused.eval()
        outs = model_or_fused(x)
    outs = list(outs) if fused else [outs]
    return [(F.cross_entropy(o, y).item(), (o.argmax(1) == y).float().mean().item()) for o in outs]


# ---- fused training equals training alone -------------------------------------------------


@pytest.mark.parametrize("kind,opt_name", [("mlp", "sgd"), ("mlp", "adam"), ("cnn", "sgd"),
                                           ("cnn", "adamw"), ("mlp", "sgd_mixed")])
def test_fused_training_equals_alone(kind, opt_name):
    steps = 20
    alone, aopts, ascheds, alosses = _train_alone(kind, opt_name, steps)
    fused_models, fopts, fscheds, flosses, fused, _ = _train_fused(kind, opt_name, steps)
    for k in range(K):
        _close(torch.tensor(flosses[k]), torch.tensor(alosses[k]), f"model {k} losses")
        _same_state(fused_models[k].state_dict(), alone[k].state_dict(), f"model {k} weights")
        _same_state(fopts[k].state_dict(), aopts[k].state_dict(), f"model {k} optimizer")
        assert fscheds[k].state_dict() == ascheds[k].state_dict()
        assert fopts[k].param_groups[0]["lr"] == aopts[k].param_groups[0]["lr"]
    if opt_name == "sgd_mixed":  # torch.optim keeps no momentum buffer for momentum 0
        assert fopts[0].state_dict()["state"] == {} != fopts[1].state_dict()["state"]
    # The learning rates did differ, and the schedules moved them.
    assert len({o.param_groups[0]["lr"] for o in fopts}) == K
    # Metrics in eval mode (BatchNorm on running statistics): fused and each alone.
    fused_metrics = _eval_metrics(fused, kind, fused=True)
    for k in range(K):
        (fl, fa), = [fused_metrics[k]]
        (al, aa), = _eval_metrics(alone[k], kind)
        assert fa == aa
        assert fl == pytest.approx(al, rel=RTOL)


def test_dropout_draws_each_models_own_numbers():
    """With each model's RNG stream, a fused dropout layer drops what the model drops alone."""
    steps = 20
    _, _, _, alosses = _train_alone("mlp", "sgd", steps, dropout=0.3)
    _, _, _, flosses, fused, _ = _train_fused("mlp", "sgd", steps, dropout=0.3)
    for k in range(K):
        _close(torch.tensor(flosses[k]), torch.tensor(alosses[k]), f"model {k} losses")
    # Without streams: one draw over the fused tensor, the same distribution, other numbers.
    fused.train()
    out = fused(DATA["mlp"][0])
    assert out.shape == (K, 64, 5) and torch.isfinite(out).all()


def test_channel_dropout_draws_each_models_own_numbers():
    """Dropout2d (whole channels) in the channel layout, from the shared batch too; a model
    switched to eval mode alone (a trial validating) does not switch the fused layer off."""
    def net():
        return nn.Sequential(nn.Dropout2d(0.5), nn.Conv2d(3, 4, 3), nn.Dropout2d(0.3),
                             nn.Dropout(0.2))

    torch.manual_seed(0)
    models = [net() for _ in range(3)]
    alone = copy.deepcopy(models)
    fused = fuse_models(models).train()
    models[0].eval()
    x = DATA["cnn"][0]
    streams, ref_streams = _Streams([5, 6, 7]), _Streams([5, 6, 7])
    out = fused(x, rng=streams.contexts())
    for k in range(3):
        with ref_streams.use(k):
            ref = alone[k](x)
        _close(out[k], ref, f"model {k}")
        assert torch.equal(streams.states[k], ref_streams.states[k])  # the same draws


def test_batchnorm_statistics_are_per_model_in_train_and_eval_mode():
    models = _models("cnn")
    alone = copy.deepcopy(models)
    fused = fuse_models(models)
    x = DATA["cnn"][0]
    for mode in (True, False, True):
        fused.train(mode)
        out = fused(x)
        for k in range(K):
            alone[k].train(mode)
            _close(out[k], alone[k](x), f"mode {mode} model {k}")
            _same_state(models[k].state_dict(), alone[k].state_dict(), f"model {k} buffers")
    assert int(models[0].bn1.num_batches_tracked) == 2


# ---- checkpoints per trial --------------------------------------------------------------------


def _trial_state(model, opt, sched):
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict()}


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_checkpoints_have_the_alone_layout_and_resume_fused(tmp_path, opt_name):
    alone, aopts, ascheds, _ = _train_alone("mlp", opt_name, 10)
    fmodels, fopts, fscheds, _, _, _ = _train_fused("mlp", opt_name, 10)
    states = []
    for k in range(K):
        path = os.path.join(tmp_path, f"t{k}.pt")
        ckpt.save(path, _trial_state(fmodels[k], fopts[k], fscheds[k]))
        alone_path = os.path.join(tmp_path, f"a{k}.pt")
        ckpt.save(alone_path, _trial_state(alone[k], aopts[k], ascheds[k]))
        # The file holds this trial's values only (not the K models' stacked storage).
        assert os.path.getsize(path) < 1.2 * os.path.getsize(alone_path)
        state = ckpt.load(path)
        _same_state(state, ckpt.load(alone_path), f"trial {k} checkpoint")
        assert state["model"]._metadata == alone[k].state_dict()._metadata  # module versions
        states.append(state)
    # Resume fused from the per-model checkpoints: 10 more steps equal 20 steps alone.
    full, fullopts, _, _ = _train_alone("mlp", opt_name, 20)
    resumed, ropts, _, _, _, _ = _train_fused("mlp", opt_name, 10, states=states, start=10)
    for k in range(K):
        _same_state(resumed[k].state_dict(), full[k].state_dict(), f"resumed {k}")
        _same_state(ropts[k].state_dict(), fullopts[k].state_dict(), f"resumed optimizer {k}")


def test_loading_a_checkpoint_into_a_fused_model(tmp_path):
    """Loading after fusing: the model's load_state_dict writes into the fused weights; the
    optimizer's goes through FusedOptimizer.load_state_dict_of."""
    alone, aopts, ascheds, _ = _train_alone("mlp", "adam", 5)
    models = _models("mlp")
    opts = [_optimizer("adam", m, k) for k, m in enumerate(models)]
    fused = fuse_models(models)
    fopt = FusedOptimizer(fused, opts)
    for k in range(K):
        models[k].load_state_dict(alone[k].state_dict())
        fopt.load_state_dict_of(k, aopts[k].state_dict())
    for k in range(K):
        ref = fused.graph_module(DATA["mlp"][0].clone())[k]
        alone[k].train()
        torch.testing.assert_close(ref, alone[k](DATA["mlp"][0]), rtol=RTOL, atol=ATOL)
        _same_state(fopt.state_dict_of(k), aopts[k].state_dict(), f"optimizer {k}")


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_a_weight_penalty_outside_the_forward_is_folded_into_the_fused_gradients(kind):
    """A loss term that reads each model's own parameters (an L2 penalty over
    ``model.parameters()``) gives them gradients outside the fused forward:
    ``FusedOptimizer.fold_grads`` adds them to the models' slices, so every stacked
    gradient equals the model's gradient alone (forward and penalty summed) within RTOL."""
    models = _models(kind)
    alone = copy.deepcopy(models)
    x, y = next(_batches(kind, 1))
    expected = []
    for model in alone:
        model.train()
        penalty = 1e-3 * sum(p.pow(2).sum() for p in model.parameters())
        (F.cross_entropy(model(x), y) + penalty).backward()
        expected.append({n: p.grad for n, p in model.named_parameters()})
    fused = fuse_models(models)
    opt = FusedOptimizer(fused, [_optimizer("sgd", m, k) for k, m in enumerate(models)])
    fused.train()
    out = fused(x)
    loss = sum(F.cross_entropy(out[k], y) + 1e-3 * sum(p.pow(2).sum() for p in m.parameters())
               for k, m in enumerate(models))
    loss.backward()
    assert any(p.grad is not None for m in models for p in m.parameters())  # outside the forward
    assert opt.fold_grads() and not opt.fold_grads()  # folded once, then nothing left
    names = [{id(p): n for n, p in m.named_parameters()} for m in models]
    checked = 0
    for stacked, slices in fused.slices:
        if not stacked.requires_grad:
            continue
        for k, p in enumerate(slices):
            torch.testing.assert_close(stacked.grad[k], expected[k][names[k][id(p)]],
                                       rtol=RTOL, atol=ATOL)
            checked += 1
    assert checked == sum(1 for m in models for p in m.parameters() if p.requires_grad)
    assert all(p.grad is None for m in models for p in m.parameters())


def test_no_scheduler_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train_fused("mlp", "sgd", 3)


# ---- what fuses: the IR's key, and clear errors ----------------------------------------------


def test_fusion_key_from_the_ir():
    space = rt.ModelSpace(mlp(), [rt.apply_mutator("3", rt.mutators.OperatorMutator(
        {"a": nn.Linear(32, 32), "b": nn.Linear(32, 32, bias=False)}, label="m"))],
        example_input=torch.randn(2, 12))
    models = {"t0": space.replay({"m/3": "a"}), "t1": space.replay({"m/3": "b"}),
              "t2": space.replay({"m/3": "a"})}
    assert fusion_key(models["t0"]) == fusion_key(models["t2"]) != fusion_key(models["t1"])
    assert fusable_groups(models) == [("t0", "t2"), ("t1",)]
    built = [space.build({"m/3": "a"}, check=False) for _ in range(2)]
    fused = fuse_models(built)  # generated modules (fx) fuse too
    assert fused(torch.randn(3, 12)).shape == (2, 3, 5)


def test_generated_models_of_one_architecture_are_traced_once(monkeypatch):
    """fuse_models traces one of several generated models whose code, layers and tensors
    agree (fusion_check.generated_signature) and reads the others' weights by the same paths: the
    fused model computes each model's own output; a model that differs (a frozen layer) is
    traced and refused as before."""
    space = rt.ModelSpace(mlp(), [rt.apply_mutator("3", rt.mutators.OperatorMutator(
        {"a": nn.Linear(32, 32), "b": nn.Linear(32, 32, bias=False)}, label="m"))],
        example_input=torch.randn(2, 12))
    built = []
    for seed in range(3):
        torch.manual_seed(seed)  # own weights
        built.append(space.build({"m/3": "a"}, check=False))
    x = torch.randn(5, 12)
    alone = [m(x) for m in built]
    traces = []
    real = torch.fx.symbolic_trace
    monkeypatch.setattr(torch.fx, "symbolic_trace", lambda m, *a, **k: traces.append(m) or real(m, *a, **k))
    fused = fuse_models(built)
    assert len(traces) == 1
    out = fused(x)
    for k in range(3):
        torch.testing.assert_close(out[k], alone[k], rtol=1e-6, atol=1e-7)
    other = [space.build({"m/3": "a"}, check=False) for _ in range(2)]
    other[1].get_submodule("0").requires_grad_(False)
    alone = [m(x) for m in other]
    fused = fuse_models(other)  # layer "0" differs: each model runs its own there
    assert len(traces) == 3  # the differing model was traced, not assumed equal
    assert any(isinstance(m, PerModelSegment) for m in fused.modules())
    for k in range(2):
        torch.testing.assert_close(fused(x)[k], alone[k], rtol=1e-6, atol=1e-7)


def test_unsupported_layer_optimizer_and_mismatch_give_clear_errors():
    class WithEmbedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, x):
            return self.emb(x)

    with pytest.raises(FusionError, match=r"'emb'.*Embedding.*separately"):
        fuse_models([WithEmbedding(), WithEmbedding()])
    with pytest.raises(FusionError, match="differs from model 0.*every layer with weights"):
        fuse_models([mlp(), nn.Sequential(nn.Linear(12, 5))])
    with pytest.raises(FusionError, match="two or more"):
        fuse_models([mlp()])
    models = _models("mlp", n=2)
    fused = fuse_models(models)
    with pytest.raises(FusionError, match=r"RMSprop.*separately"):
        FusedOptimizer(fused, [torch.optim.RMSprop(m.parameters()) for m in models])
    with pytest.raises(FusionError, match="amsgrad"):
        FusedOptimizer(fused, [torch.optim.Adam(m.parameters(), amsgrad=True) for m in models])
    frozen = _models("mlp", n=2)
    for m in frozen:
        m[0].requires_grad_(False)  # a frozen first layer fuses too; it never steps
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in frozen]
    fopt = FusedOptimizer(fuse_models(frozen), opts)
    assert len(fopt.params) == len(list(frozen[0].parameters())) - 2
    with pytest.raises(FusionError, match="does not hold"):
        FusedOptimizer(fused, [torch.optim.SGD(list(m.parameters())[:2], lr=0.1)
                               for m in models])


# ---- with the engine's TrialRun: its RNG streams, its checkpoints ------------------------------


def test_trial_runs_train_fused_and_checkpoint_as_alone(tmp_path):
    """TrialRuns (the engine's per-trial state) fused for an epoch: each run's checkpoint
    (weights, optimizer, cosine schedule, RNG streams with dropout drawn in them, position)
    equals its alone run's, and a run resumed alone from it trains on as if never fused."""
    from retiarii.engine.trainers.trainer import ClassifierTrainer
    from retiarii.engine.trainers.trial_training import TrialRun

    trainer = ClassifierTrainer(epochs=2, batch_size=128, lr_schedule="cosine")
    hps = [{"lr": 1e-3}, {"lr": 3e-3}, {"lr": 2e-3}]

    def build():
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.2),
                             nn.Linear(32, 10))

    def runs():
        return [TrialRun(build, trainer, hp, seed=7 + i, trial_id=f"t{i}", device="cpu")
                for i, hp in enumerate(hps)]

    alone = runs()
    metrics = [r.train_epoch() for r in alone]
    fused_runs = runs()
    fused = fuse_models([r.model for r in fused_runs])
    fopt = FusedOptimizer(fused, [r.optimizer for r in fused_runs])
    fused.train()
    sums = [[torch.zeros(()), 0] for _ in fused_runs]
    for x, y in trainer.train_dataloader(hps[0], 0):
        out = fused(x, rng=[r._own_rng for r in fused_runs])  # dropout in each trial's streams
        losses = [F.cross_entropy(out[k], y) for k in range(len(fused_runs))]
        fopt.zero_grad()
        sum(losses).backward()
        fopt.step()
        for k, loss in enumerate(losses):
            sums[k][0] += loss.detach() * len(y)
            sums[k][1] += len(y)
    for k, run in enumerate(fused_runs):
        with run._own_rng():
            train_loss = run.end_training(*sums[k])  # the epoch's cosine step
            fused_metrics = {"train_loss": train_loss, **run._validate()}
        run.epoch += 1
        for name, value in metrics[k].items():
            assert fused_metrics[name] == pytest.approx(value, rel=RTOL), name
        state, ref = run.state_dict(), alone[k].state_dict()
        assert torch.equal(state["rng"]["torch"], ref["rng"]["torch"])  # the same draws
        _same_state(state, ref, f"trial {k} checkpoint")
        path = os.path.join(tmp_path, f"t{k}.pt")
        run.save(path)
        resumed = TrialRun(build, trainer, hps[k], checkpoint=path, trial_id=f"t{k}",
                           device="cpu")
        after, ref_after = resumed.train_epoch(), alone[k].train_epoch()
        assert after == pytest.approx(ref_after, rel=1e-4)
        _same_state(resumed.state_dict(), alone[k].state_dict(), f"trial {k} resumed alone")
