"""The weight-sharing super-graph (retiarii/optim/supergraph.py): keys, paths, training equal to
a checkpoint-to-file baseline, checkpoints, export, slicing, errors."""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import retiarii as rt
from retiarii.mutators import OperatorMutator
from retiarii.optim.supergraph import SuperGraph, SuperGraphError
from retiarii.optim.weight_keys import weight_keys
from retiarii.sampler import ReplaySampler

X = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 5, (6,), generator=torch.Generator().manual_seed(1))


def unit(k: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(4, 4, k, padding=k // 2), nn.BatchNorm2d(4), nn.ReLU())


class Stack(nn.Module):
    """A frozen stem, then three blocks each choosing conv3 / conv5 / pool, then a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # frozen values must be deterministic (space.py)
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.stem.requires_grad_(False)
        self.blocks = nn.Sequential(*[rt.LayerChoice(
            {"conv3": unit(3), "conv5": unit(5), "pool": nn.MaxPool2d(3, 1, 1)},
            label=f"block{i}") for i in range(3)])
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def stack_space() -> rt.ModelSpace:
    return rt.ModelSpace(Stack(), example_input=X[:1])


def sample(b0="conv3", b1="conv3", b2="conv3") -> dict:
    return {"block0": b0, "block1": b1, "block2": b2}


def params_of(net: nn.Module) -> dict[str, int]:
    return {name: id(p) for name, p in net.named_parameters()}


# ---- keys and sharing ---------------------------------------------------------------------------


def test_paths_share_the_parameters_of_shared_operators_only():
    space = stack_space()
    sg = SuperGraph(space)
    a = sg.path(sample("conv3", "conv5", "pool"))
    b = sg.path(sample("conv5", "conv5", "conv3"))
    pa, pb = params_of(a), params_of(b)
    # block1 chose conv5 in both: one set of weights, whatever block0 chose
    assert pa["blocks.1.conv5.0.weight"] == pb["blocks.1.conv5.0.weight"]
    assert pa["head.weight"] == pb["head.weight"] and pa["stem.weight"] == pb["stem.weight"]
    # block0 chose differently: nothing shared there
    assert not {v for k, v in pa.items() if k.startswith("blocks.0")} & \
        {v for k, v in pb.items() if k.startswith("blocks.0")}
    # BatchNorm buffers are shared like weights
    assert a.get_buffer("blocks.1.conv5.1.running_mean") is \
        b.get_buffer("blocks.1.conv5.1.running_mean")
    # the frozen stem: shared, no grad, the base model's values
    stem = a.get_parameter("stem.weight")
    assert not stem.requires_grad
    torch.testing.assert_close(stem, space._frozen[0]["stem"]["stem.weight"], rtol=0, atol=0)
    # every candidate seen so far, once: stem, head, 4 conv units (block0: 2, block1: 1,
    # block2: 1; a conv and a BatchNorm each)
    assert len(sg) == 2 + 4 * 2
    assert len(sg.parameters()) == len({id(p) for p in sg.parameters()})
    # names that mean one weight whatever order the pool grew in
    other = SuperGraph(space)
    other.path(sample("conv5", "conv5", "conv3"))
    other.path(sample("conv3", "conv5", "pool"))
    assert sorted(n for n, _ in other.named_parameters()) == \
        sorted(n for n, _ in sg.named_parameters())
    assert [id(p) for _, p in sg.named_parameters()] == [id(p) for p in sg.parameters()]


def test_keys_hold_only_the_choice_that_made_the_operator():
    space = stack_space()
    k1 = weight_keys(space, space.replay(sample("conv3", "pool", "conv5")))
    k2 = weight_keys(space, space.replay(sample("pool", "conv3", "conv5")))
    assert k1["blocks.2.conv5.0"].key == k2["blocks.2.conv5.0"].key
    assert "block2=conv5" in k1["blocks.2.conv5.0"].key
    assert "block0" not in k1["blocks.2.conv5.0"].key and "block1" not in \
        k1["blocks.2.conv5.0"].key
    assert k1["head"].key == k2["head"].key and k1["head"].key.startswith("base0/head@")
    assert k1["stem"].frozen and not k1["head"].frozen
    assert "blocks.0.pool" not in k2  # weightless operators are not pooled


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(self.conv3(x).mean((2, 3)))


def test_keys_of_a_mutator_space_ignore_the_other_targets_choices():
    ops = {"conv5": nn.Conv2d(8, 8, 5, padding=2), "conv1": nn.Conv2d(8, 8, 1),
           "pool": nn.MaxPool2d(3, 1, 1)}
    space = rt.ModelSpace(ConvNet(), [rt.apply_mutator("conv[23]", OperatorMutator(ops,
                                                                                   label="op"))],
                          example_input=X[:1])
    a = space.replay({"op/conv2": "conv5", "op/conv3": "conv1"})
    b = space.replay({"op/conv2": "pool", "op/conv3": "conv1"})
    c = space.replay({"op/conv2": "conv5", "op/conv3": "conv5"})
    ka, kb, kc = (weight_keys(space, m) for m in (a, b, c))
    assert ka["conv3"].key == kb["conv3"].key == "op[op/conv3=conv1]/conv3@" + \
        ka["conv3"].key.rpartition("@")[2]
    assert ka["conv2"].key == kc["conv2"].key and ka["conv3"].key != kc["conv3"].key
    assert ka["conv1"].key.startswith("base0/conv1@")
    sg = SuperGraph(space)
    pa, pb = params_of(sg.path(a)), params_of(sg.path(b))
    assert pa["conv3.weight"] == pb["conv3.weight"] and pa["conv1.weight"] == pb["conv1.weight"]
    assert "conv2.weight" not in pb  # a pool there


class Inline(nn.Module):
    """InputChoice, Repeat and a shape-keeping ValueChoice (a stride-free eps) together."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = rt.Repeat(lambda i: nn.Sequential(nn.Linear(4, 4), nn.ReLU()), depth=(1, 3),
                           label="depth")
        self.norm = rt.nn.LayerNorm(4, eps=rt.ValueChoice([1e-5, 1e-3], label="eps"))
        self.pick = rt.InputChoice(2, 1, label="pick")
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(self.pick([self.a(x), self.norm(self.b(x))]))


def test_inline_spaces_share_repeat_blocks_and_value_candidates_of_one_shape():
    space = rt.ModelSpace(Inline(), example_input=torch.zeros(1, 4))
    sg = SuperGraph(space)
    deep = sg.path({"pick": 1, "depth": 3, "eps": 1e-3})
    shallow = sg.path({"pick": 1, "depth": 1, "eps": 1e-5})
    only_a = sg.path({"pick": 0})
    pd, ps, pa = params_of(deep), params_of(shallow), params_of(only_a)
    assert pd["b.blocks.0.0.weight"] == ps["b.blocks.0.0.weight"]
    assert "b.blocks.1.0.weight" not in ps and pa.keys() == {"a.weight", "a.bias", "fc.weight",
                                                            "fc.bias"}
    # the two eps values share one LayerNorm's weights, each path keeps its own eps
    assert pd["norm.weight"] == ps["norm.weight"]
    assert deep.get_submodule("norm").eps == 1e-3 and shallow.get_submodule("norm").eps == 1e-5
    assert pa["fc.weight"] == pd["fc.weight"]
    v = torch.randn(2, 4)
    torch.testing.assert_close(deep(v), sg.export({"pick": 1, "depth": 3, "eps": 1e-3})(v))


@pytest.mark.parametrize("name", ["spos", "nasbench201", "darts"])
def test_model_spaces_paths_equal_their_exports(name):
    """Paths of the literature's spaces (cells and layouts reused across samples, paths.py)
    compute what the standalone model with the inherited weights computes."""
    import importlib

    space = importlib.import_module(f"model_spaces.{name}").small()
    sg = SuperGraph(space)
    x = torch.randn(2, *space.example_input.shape[1:], generator=torch.Generator().manual_seed(0))
    models = [space.random_sample(seed) for seed in range(2)]
    for model in models:
        sg.path(model.sample)  # fill the pool and the caches first
    for model in models:
        net = sg.path(model).eval()
        torch.testing.assert_close(net(x), sg.export(model.sample).eval()(x))
    if name == "spos":
        # one layout for all, one cell per (block, candidate) met: no code generated twice
        assert len(sg._builder._layouts) == 1
        assert len(sg._builder._cells) == len({(label, m.sample[label]) for m in models
                                               for label in m.sample})
        # block3's candidate: one key whatever the other blocks chose
        a, b = (space.replay({**models[0].sample, "block1": c}) for c in ("choice_3", "choice_x"))
        ka, kb = weight_keys(space, a), weight_keys(space, b)
        shared = [attr for attr in ka if attr.startswith("layers.2.")]
        assert shared and all(ka[attr].key == kb[attr].key for attr in shared)


class Tensors(nn.Module):
    """Parameters read directly: a frozen scale and a trainable shift, around a choice."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 4), requires_grad=False)
        self.shift = nn.Parameter(torch.zeros(4))
        self.op = rt.LayerChoice({"lin": nn.Linear(4, 4), "tanh": nn.Tanh()}, label="op")

    def forward(self, x):
        return self.op(x * self.scale) + self.shift


def test_parameters_read_directly_are_pooled_frozen_or_trainable():
    space = rt.ModelSpace(Tensors(), example_input=torch.zeros(1, 4))
    sg = SuperGraph(space)
    a, b = sg.path({"op": "lin"}), sg.path({"op": "tanh"})
    assert a.scale is b.scale and a.shift is b.shift
    assert not a.scale.requires_grad and a.shift.requires_grad
    torch.testing.assert_close(a.scale, torch.linspace(0.5, 2.0, 4), rtol=0, atol=0)
    opt = torch.optim.SGD([{"params": sg.parameters()}], lr=0.5)
    sg.attach(opt)
    v = torch.randn(3, 4, generator=torch.Generator().manual_seed(4))
    opt.zero_grad()
    b(v).sum().backward()
    opt.step()
    torch.testing.assert_close(a.shift, torch.full((4,), -1.5))  # 3 rows, lr 0.5
    torch.testing.assert_close(a(v), sg.export({"op": "lin"})(v))


# ---- training equals a checkpoint-to-file baseline ------------------------------------------------


def _train_step(net, opt, x, y):
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(net(x), y).backward()
    opt.step()


def _checkpoint_baseline(space, samples, batches, path, lr, momentum):
    """Each model built alone; it loads the shared weights and SGD momentum from a file,
    trains one batch and saves them back. Operators it meets first start from their seeded
    initial values (SuperGraph(space).export_state: the same init the super-graph uses)."""
    init = SuperGraph(space)
    torch.save({"weights": {}, "momentum": {}}, path)
    for smp, (x, y) in zip(samples, batches):
        model = space.replay(smp)
        net = space.build(smp, check=False)
        keys = weight_keys(space, model)
        saved = torch.load(path)

        def where(name):  # model state key -> (weight key, name in the pooled operator)
            attr = max((a for a in keys if name == a or name.startswith(a + ".")), key=len)
            op = keys[attr]
            return op.key, ("value" if op.kind == "param" else name[len(attr) + 1:])

        state = init.export_state(smp)
        for name in state:
            k = where(name)
            if k in saved["weights"]:
                state[name] = saved["weights"][k]
        net.load_state_dict(state)
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
        for name, p in net.named_parameters():
            if where(name) in saved["momentum"]:
                opt.state[p]["momentum_buffer"] = saved["momentum"][where(name)].clone()
        _train_step(net, opt, x, y)
        for name, t in net.state_dict().items():
            saved["weights"][where(name)] = t.detach().clone()
        for name, p in net.named_parameters():
            if "momentum_buffer" in opt.state.get(p, {}):
                saved["momentum"][where(name)] = opt.state[p]["momentum_buffer"].clone()
        torch.save(saved, path)
    return torch.load(path)


def _sequence(n: int, seed: int = 0):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    samples = [sample(*(rng.choice(["conv3", "conv5", "pool"]) for _ in range(3)))
               for _ in range(n)]
    batches = [(torch.randn(8, 3, 8, 8, generator=gen), torch.randint(0, 5, (8,), generator=gen))
               for _ in range(n)]
    return samples, batches


def test_training_equals_checkpoint_to_file_baseline(tmp_path):
    """N = 20 single-batch steps of sampled models: same weights, BatchNorm statistics and
    momentum as the baseline, within 1e-6 relative (CPU, float32; the two run the same
    kernels on the same values, so they agree to rounding)."""
    space = stack_space()
    samples, batches = _sequence(20)
    sg = SuperGraph(space)
    opt = torch.optim.SGD([{"params": sg.parameters()}], lr=0.1, momentum=0.9)
    sg.attach(opt)
    for smp, (x, y) in zip(samples, batches):
        net = sg.path(smp)
        net.train()
        _train_step(net, opt, x, y)
    ref = _checkpoint_baseline(space, samples, batches, tmp_path / "shared.pt", 0.1, 0.9)
    assert {k for k, _ in ref["weights"]} == set(sg.keys())
    for (key, name), value in ref["weights"].items():
        mine = sg.module(key).state_dict()[name]
        torch.testing.assert_close(mine, value, rtol=1e-6, atol=1e-7)
    assert len(ref["momentum"]) == sum(p.requires_grad for p in sg.parameters())
    for (key, name), buf in ref["momentum"].items():
        p = sg.module(key).get_parameter(name)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf, rtol=1e-6, atol=1e-7)
    # the stem is frozen: never trained, still the base's values
    stem = next(k for k in sg.keys() if "/stem@" in k)
    torch.testing.assert_close(sg.module(stem).weight, space._frozen[0]["stem"]["stem.weight"],
                               rtol=0, atol=0)


# ---- checkpoints ---------------------------------------------------------------------------------


def test_state_dict_round_trip_and_resume_equal_an_uninterrupted_run(tmp_path):
    space = stack_space()
    samples, batches = _sequence(10, seed=3)

    def run(sg, opt, steps):
        for smp, (x, y) in steps:
            _train_step(sg.path(smp).train(), opt, x, y)

    whole = SuperGraph(space)
    opt = torch.optim.SGD([{"params": whole.parameters()}], lr=0.05, momentum=0.9)
    whole.attach(opt)
    run(whole, opt, list(zip(samples, batches)))

    first = SuperGraph(space)
    opt1 = torch.optim.SGD([{"params": first.parameters()}], lr=0.05, momentum=0.9)
    first.attach(opt1)
    run(first, opt1, list(zip(samples[:5], batches[:5])))
    torch.save({"sg": first.state_dict(), "opt": opt1.state_dict()}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt")
    second = SuperGraph(space, seed=5)  # the saved seed wins: later operators start alike
    second.load_state_dict(ckpt["sg"])
    assert second.keys() == first.keys()
    # a fresh super-graph with the state: identical outputs, before any path was asked for
    for smp in samples[:5]:
        a, b = first.path(smp).eval(), second.path(smp).eval()
        torch.testing.assert_close(a(X), b(X), rtol=0, atol=0)
    opt2 = torch.optim.SGD(second.parameters(), lr=0.05, momentum=0.9)
    opt2.load_state_dict(ckpt["opt"])
    second.attach(opt2)
    run(second, opt2, list(zip(samples[5:], batches[5:])))
    assert second.keys() == whole.keys() and len(first) < len(whole)  # some added after
    for key in whole.keys():
        for name, t in whole.module(key).state_dict().items():
            torch.testing.assert_close(second.module(key).state_dict()[name], t, rtol=0, atol=0)


def test_load_state_dict_overwrites_in_place_and_refuses_foreign_state():
    space = stack_space()
    sg = SuperGraph(space)
    net = sg.path(sample())
    before = params_of(net)
    other = SuperGraph(space, seed=7)
    other.path(sample())
    sg.load_state_dict(other.state_dict())
    assert params_of(sg.path(sample())) == before  # same Parameter objects, new values
    torch.testing.assert_close(net(X), other.path(sample())(X), rtol=0, atol=0)
    with pytest.raises(SuperGraphError, match="not a SuperGraph state"):
        sg.load_state_dict({"weights": {}})


# ---- export --------------------------------------------------------------------------------------


def test_export_is_a_standalone_model_with_the_inherited_weights():
    space = stack_space()
    sg = SuperGraph(space)
    opt = torch.optim.SGD([{"params": sg.parameters()}], lr=0.1)
    sg.attach(opt)
    smp = sample("conv5", "pool", "conv3")
    net = sg.path(smp).train()
    _train_step(net, opt, X, Y)
    exported = sg.export(smp)
    assert not {id(p) for p in exported.parameters()} & {id(p) for p in sg.parameters()}
    assert type(exported).__name__ != "Path"
    torch.testing.assert_close(exported.eval()(X), net.eval()(X), rtol=0, atol=0)
    state = sg.export_state(smp)
    assert state.keys() == space.build(smp).state_dict().keys()


# ---- slicing -------------------------------------------------------------------------------------


class Widths(nn.Module):
    """A width and a kernel-size choice on convolutions, their BatchNorm and the classifier."""

    def __init__(self):
        super().__init__()
        width = rt.ValueChoice([4, 8, 6], label="width")
        kernel = rt.ValueChoice([3, 5], label="kernel")
        self.conv = rt.nn.Conv2d(3, width, kernel, padding=kernel // 2)
        self.bn = rt.nn.BatchNorm2d(width)
        self.dw = rt.nn.Conv2d(width, width, 3, padding=1, groups=width)
        self.fc = rt.nn.Linear(width, 5)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc(self.dw(x).mean((2, 3)))


def test_width_and_kernel_choices_slice_one_module_of_the_largest_size():
    space = rt.ModelSpace(Widths(), example_input=X[:1])
    sg = SuperGraph(space)
    small = sg.path({"width": 4, "kernel": 3})
    large = sg.path({"width": 8, "kernel": 5})
    assert len(sg) == 4  # conv, bn, dw, fc: one module each for every width and kernel
    conv = sg.module(weight_keys(space, space.replay({"width": 4, "kernel": 3}))["conv"].key)
    assert tuple(conv.weight.shape) == (8, 3, 5, 5)
    assert params_of(small)["conv.big.weight"] == params_of(large)["conv.big.weight"]
    # the small path's conv is the big weight's leading channels, kernel centre-cropped
    w = small.state_dict()["conv.weight"]
    torch.testing.assert_close(w, conv.weight[:4, :, 1:4, 1:4], rtol=0, atol=0)
    # forward of the small path equals the standalone model built from the sliced weights
    for smp in ({"width": 4, "kernel": 3}, {"width": 6, "kernel": 5}):
        net = sg.path(smp).train()
        exported = sg.export(smp).train()
        torch.testing.assert_close(net(X), exported(X))
        torch.testing.assert_close(net.eval()(X), exported.eval()(X))


def test_gradient_reaches_only_the_used_slice():
    space = rt.ModelSpace(Widths(), example_input=X[:1])
    sg = SuperGraph(space)
    net = sg.path({"width": 4, "kernel": 3}).train()
    nn.functional.cross_entropy(net(X), Y).backward()
    conv = net.get_submodule("conv").big
    g = conv.weight.grad  # (8, 3, 5, 5)
    used = torch.zeros_like(g, dtype=torch.bool)
    used[:4, :, 1:4, 1:4] = True
    assert g[used].abs().sum() > 0 and g[~used].abs().sum() == 0
    # hand check of the gradient of the used slice against the standalone model's
    exported = sg.export({"width": 4, "kernel": 3}).train()
    nn.functional.cross_entropy(exported(X), Y).backward()
    torch.testing.assert_close(g[:4, :, 1:4, 1:4], exported.conv.weight.grad)
    fc = net.get_submodule("fc").big
    assert fc.weight.grad[:, 4:].abs().sum() == 0 and fc.weight.grad[:, :4].abs().sum() > 0
    bn = net.get_submodule("bn").big
    assert bn.running_mean[4:].abs().sum() == 0 and bn.running_mean[:4].abs().sum() > 0


# ---- errors ------------------------------------------------------------------------------------


def test_samples_and_models_of_another_space_are_refused():
    sg = SuperGraph(stack_space())
    with pytest.raises(SuperGraphError, match="not one of this space's.*block9"):
        sg.path({**sample(), "block9": "conv3"})
    other = rt.ModelSpace(Inline(), example_input=torch.zeros(1, 4))
    with pytest.raises(SuperGraphError, match="not a model of this space"):
        sg.path(other.replay({"pick": 0}))
    with pytest.raises(SuperGraphError, match="expected a sample"):
        sg.path(["block0"])


class LazyStack(nn.Module):
    """A LazyConv2d (in_channels settled by the first input) after a choice of block."""

    def __init__(self):
        super().__init__()
        self.block = rt.LayerChoice({"conv": nn.Conv2d(3, 4, 3, padding=1),
                                     "wide": nn.Conv2d(3, 6, 3, padding=1)}, label="block")
        self.lazy = nn.LazyConv2d(5, 1)

    def forward(self, x):
        return self.lazy(self.block(x)).mean((2, 3))


def test_a_sampled_model_with_lazy_modules_is_its_spaces_model():
    # space.sample leaves LazyConv2d unsettled; the super-graph's replay settles it on
    # example_input: the two graphs differ by the settled sizes only, and are the same model
    space = rt.ModelSpace(LazyStack(), example_input=X[:1])
    for pick in ("conv", "wide"):
        model = space.sample(ReplaySampler({"block": pick}))
        sg = SuperGraph(space)
        net = sg.path(model)
        assert net(X).shape == (6, 5)
        assert sg.path({"block": pick}) is net  # the sample finds the same path
        ref = space.build({"block": pick})
        ref.load_state_dict(sg.export_state({"block": pick}))
        torch.testing.assert_close(net(X), ref(X), rtol=0, atol=1e-6)


class Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = rt.nn.LayerNorm(rt.ValueChoice([4, 8], label="dim"))

    def forward(self, x):
        return self.norm(x)


def test_an_op_whose_candidates_change_shape_unslicably_is_a_clear_error():
    space = rt.ModelSpace(Norms(), example_input=torch.zeros(1, 4))
    with pytest.raises(SuperGraphError, match=r"node 'norm'.*'dim'.*LayerNorm.*slicing"):
        SuperGraph(space).path({"dim": 4})


# ---- the benchmark ---------------------------------------------------------------------------


@pytest.mark.slow
def test_benchmark_quick_mode_runs(tmp_path, monkeypatch):
    """benchmarks/supergraph.py --quick (tens of seconds on the shared 2-core CPU: slow)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "supergraph.py"
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location("bench_supergraph", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = importlib.import_module("_out")
    monkeypatch.setattr(out, "OUT", str(tmp_path))
    rows = bench.main(["--quick"])
    assert [r["batch"] for r in rows] == [32] and rows[0]["supergraph_models_per_s"] > 0
    assert (tmp_path / "supergraph-cpu.csv").exists()


@pytest.mark.gpu
def test_paths_train_on_a_gpu_and_export_there():
    device = torch.device("cuda")
    space = rt.ModelSpace(Widths(), example_input=X[:1])
    sg = SuperGraph(space, device=device)
    opt = torch.optim.SGD([{"params": sg.parameters()}], lr=0.1, momentum=0.9)
    sg.attach(opt)
    x, y = X.to(device), Y.to(device)
    for smp in ({"width": 4, "kernel": 3}, {"width": 8, "kernel": 5}, {"width": 6, "kernel": 3}):
        _train_step(sg.path(smp).train(), opt, x, y)
    assert all(p.device.type == "cuda" for p in sg.parameters())
    net = sg.path({"width": 6, "kernel": 3}).eval()
    exported = sg.export({"width": 6, "kernel": 3}).eval()
    assert next(exported.parameters()).device.type == "cuda"
    torch.testing.assert_close(net(x), exported(x))
