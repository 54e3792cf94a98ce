"""Graph IR tests: every zoo model round-trips exactly, and bad input fails clearly.

The reference is always the original PyTorch model: the regenerated module (``to_module``) and
the exported source (``to_source``, run in a process where retiarii cannot be imported) must
have its state-dict keys, in order, and produce bit-identical outputs on CPU, in eval and in
train mode (dropout seeded the same before both calls).
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import retiarii
import zoo
from retiarii import Graph, GraphError, Operation, TraceError
from zoo_leaf import Activation

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
CASES = {c.name: c for c in zoo.cases()}


# ---- helpers --------------------------------------------------------------------------------


def assert_same(expected, got, where: str = "output") -> None:
    """Equal structure and bit-identical tensors (dtype and shape included)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: expected a tensor, got {type(got)}"
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), where
        assert torch.equal(got, expected), f"{where}: values differ"
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), where
        for i, (e, g) in enumerate(zip(expected, got)):
            assert_same(e, g, f"{where}[{i}]")
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and list(got) == list(expected), where
        for k in expected:
            assert_same(expected[k], got[k], f"{where}[{k!r}]")
    else:
        assert got == expected and type(got) is type(expected), where


def run_modes(model: nn.Module, inputs_fn) -> list:
    """Outputs in eval mode, then in train mode, with torch's RNG seeded before each call."""
    outs = []
    for train in (False, True):
        model.train(train)
        torch.manual_seed(1234)
        with torch.no_grad():
            outs.append(model(*inputs_fn()))
    return outs


def grads_of_train_step(model: nn.Module, inputs_fn) -> dict:
    """Parameter gradients of the sum of all differentiable outputs, in train mode."""
    model.train()
    model.zero_grad()
    torch.manual_seed(1234)
    leaves, todo = [], [model(*inputs_fn())]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            todo += list(v.values())
        elif isinstance(v, (list, tuple)):
            todo += list(v)
        elif isinstance(v, torch.Tensor) and v.requires_grad:
            leaves.append(v)
    sum(t.sum() for t in leaves).backward()
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


@functools.lru_cache(maxsize=None)
def traced_json(name: str) -> str:
    case = CASES[name]
    return retiarii.trace(case.build(), **case.trace_kwargs).to_json()


def traced(name: str) -> Graph:
    """A fresh Graph of a zoo model (tracing is cached as JSON)."""
    return Graph.from_json(traced_json(name))


# ---- the zoo: trace, lint, JSON, to_module ------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_trace_lint_and_json_round_trip(name):
    case = CASES[name]
    graph = retiarii.trace(case.build(), **case.trace_kwargs)
    graph.lint()
    text = graph.to_json()
    again = Graph.from_json(text)
    again.lint()
    assert again.to_json() == text
    assert again.structural_hash() == graph.structural_hash()
    assert again.node_hashes() == graph.node_hashes()
    assert graph.copy().to_json() == text
    # tracing the same model twice gives the same IR, text included
    assert retiarii.trace(case.build(), **case.trace_kwargs).to_json() == text


@pytest.mark.parametrize("name", CASES)
def test_to_module_equals_original(name):
    case = CASES[name]
    model = case.build()
    module = traced(name).to_module()
    assert list(module.state_dict()) == list(model.state_dict())
    module.load_state_dict(model.state_dict())
    expected = run_modes(model, case.inputs)
    assert_same(expected, run_modes(module, case.inputs))
    # train mode updated the same running statistics
    assert_same(model.state_dict(), module.state_dict(), "state_dict")
    # and a backward pass gives the same gradients
    assert_same(grads_of_train_step(model, case.inputs), grads_of_train_step(module, case.inputs),
                "grad")


def test_buffers_stay_buffers():
    """A buffer used without any input (``self.table[:, 1:] @ w``) must not be folded into a
    constant at trace time: the regenerated model reads the buffer it is given."""
    model = zoo.TensorOps()
    graph = retiarii.trace(model)
    assert graph["table"].kind == "param" and graph["table"].op.spec["buffer"]
    model.table.mul_(-3)  # new values after tracing: loaded, not baked in
    module = graph.to_module()
    module.load_state_dict(model.state_dict())
    x = torch.randn(2, 2, 4, 4)
    assert_same(model(x), module(x))
    assert retiarii.trace(zoo.TwoTower())["step"].kind == "param"  # self.step + 1


def test_resnet50_round_trip():
    model = zoo.resnet50().eval()
    graph = retiarii.trace(model)
    graph.lint()
    text = graph.to_json()
    again = Graph.from_json(text)
    assert again.to_json() == text
    module = again.to_module().eval()
    assert list(module.state_dict()) == list(model.state_dict())
    module.load_state_dict(model.state_dict())
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(model(x), module(x))


def test_source_lines_point_at_user_code():
    graph = traced("resnet_basic")
    source = graph["layer1.0.conv1"].meta["source"]
    assert "zoo.py:" in source and "self.conv1(x)" in source


# ---- the export: standalone source, run where retiarii is not importable -------------------

_RUNNER = '''
import importlib.util, sys

sys.path.insert(0, {tests_dir!r})  # where the user's leaf modules (zoo_leaf.py) live

class _NoRetiarii:
    """python -I keeps PYTHONPATH and the working directory out; this keeps out an installed
    copy too (./dev installs retiarii in editable mode)."""

    def find_spec(self, name, path=None, target=None):
        if name == "retiarii" or name.startswith("retiarii."):
            raise ImportError("retiarii is not available to exported models")

sys.meta_path.insert(0, _NoRetiarii())
try:
    import retiarii  # noqa: F401
    isolated = False
except ImportError:
    isolated = True

import torch

torch.set_num_threads({threads})  # as in the test process: same reduction order, same bits
results = {{}}
for name in {names!r}:
    spec = importlib.util.spec_from_file_location("exported_" + name, name + ".py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.Exported()
    state = torch.load(name + ".pt")
    keys_match = list(model.state_dict()) == list(state)
    model.load_state_dict(state)
    inputs = torch.load(name + ".in.pt")
    outs = []
    for train in (False, True):
        model.train(train)
        torch.manual_seed(1234)
        with torch.no_grad():
            outs.append(model(*inputs))
    results[name] = {{"keys_match": keys_match, "outputs": outs,
                      "state": model.state_dict()}}
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "retiarii")
torch.save({{"isolated": isolated, "loaded": loaded, "results": results}}, "results.pt")
'''


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Export every zoo model, run them all in one isolated subprocess, return its results."""
    tmp = tmp_path_factory.mktemp("export")
    expected = {}
    for name, case in CASES.items():
        model = case.build()
        (tmp / f"{name}.py").write_text(traced(name).to_source("Exported"))
        torch.save(model.state_dict(), tmp / f"{name}.pt")
        torch.save(case.inputs(), tmp / f"{name}.in.pt")
        outputs = run_modes(model, case.inputs)
        expected[name] = {"outputs": outputs, "state": model.state_dict()}
    (tmp / "run.py").write_text(_RUNNER.format(tests_dir=TESTS_DIR, names=list(CASES),
                                               threads=torch.get_num_threads()))
    proc = subprocess.run([sys.executable, "-I", "run.py"], cwd=tmp, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"the exported models failed:\n{proc.stderr[-4000:]}"
    return torch.load(tmp / "results.pt"), expected


def test_export_runs_without_retiarii(exported):
    results, _ = exported
    assert results["isolated"], "retiarii was importable in the export subprocess"
    assert results["loaded"] == []


@pytest.mark.parametrize("name", CASES)
def test_export_equals_original(name, exported):
    results, expected = exported
    got = results["results"][name]
    assert got["keys_match"]
    assert_same(expected[name]["outputs"], got["outputs"])
    assert_same(expected[name]["state"], got["state"], "state_dict")


def test_export_is_readable():
    src = traced("resnet_basic").to_source("ResNet")
    assert "class ResNet(nn.Module):" in src
    assert "nn.Conv2d(3, 4, 7, stride=2, padding=3, bias=False)" in src
    assert "import retiarii" not in src and "from retiarii" not in src
    compile(src, "resnet.py", "exec")


# ---- structural hash ------------------------------------------------------------------------


class _MLPNamed(nn.Module):
    """The same structure as nn.Sequential(Linear(4, 8), ReLU(), Linear(8, 2)), other names."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 8)
        self.nonlinearity = nn.ReLU()
        self.decoder = nn.Linear(8, 2)

    def forward(self, inputs):
        return self.decoder(self.nonlinearity(self.encoder(inputs)))


class _Reuse(nn.Module):
    def __init__(self, shared: bool):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a if shared else nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


def test_structural_hash_equal_for_identical_models():
    for name in ("resnet_bottleneck", "darts_cell", "vit", "two_tower"):
        a = retiarii.trace(CASES[name].build(), **CASES[name].trace_kwargs)
        b = retiarii.trace(CASES[name].build(), **CASES[name].trace_kwargs)
        assert a.structural_hash() == b.structural_hash(), name
    # module weights are not structure: differently initialised ResNets hash equal
    torch.manual_seed(1)
    a = retiarii.trace(zoo.ResNet(zoo.BasicBlock, [1, 1, 1, 1], width=4))
    torch.manual_seed(2)
    b = retiarii.trace(zoo.ResNet(zoo.BasicBlock, [1, 1, 1, 1], width=4))
    assert a.structural_hash() == b.structural_hash()


def test_structural_hash_ignores_names_and_uids():
    seq = retiarii.trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    named = retiarii.trace(_MLPNamed())
    assert seq.structural_hash() == named.structural_hash()
    assert sorted(seq.node_hashes().values()) == sorted(named.node_hashes().values())
    data = seq.to_data()  # shift every uid and rename every node
    shift = {n["uid"]: n["uid"] + 1000 for n in data["nodes"]}
    for n in data["nodes"]:
        n["uid"], n["name"] = shift[n["uid"]], "renamed_" + n["name"]
    data["edges"] = [[shift[s], shift[d], p] for s, d, p in data["edges"]]
    moved = Graph.from_data(data)
    moved.lint()
    assert moved.structural_hash() == seq.structural_hash()


def test_structural_hash_differs_for_changed_models():
    base = retiarii.trace(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)))
    variants = [
        nn.Sequential(nn.Conv2d(3, 4, 5), nn.ReLU(), nn.Conv2d(4, 4, 3)),  # kernel size
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.GELU(), nn.Conv2d(4, 4, 3)),  # activation
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3), nn.ReLU()),  # order
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU()),  # extra op
    ]
    hashes = {base.structural_hash()} | {retiarii.trace(v).structural_hash() for v in variants}
    assert len(hashes) == 1 + len(variants)
    # calling one module twice (tied weights) is not two independent modules
    assert retiarii.trace(_Reuse(True)).structural_hash() != \
        retiarii.trace(_Reuse(False)).structural_hash()


def test_node_hash_changes_only_downstream():
    a = retiarii.trace(zoo.ResNet(zoo.BasicBlock, [1, 1, 1, 1], width=4))
    changed = zoo.ResNet(zoo.BasicBlock, [1, 1, 1, 1], width=4)
    changed.layer3[0].conv2 = nn.Conv2d(16, 16, 3, padding=2, dilation=2, bias=False)
    b = retiarii.trace(changed)
    ha = {a.node_by_uid(uid).name: h for uid, h in a.node_hashes().items()}
    hb = {b.node_by_uid(uid).name: h for uid, h in b.node_hashes().items()}
    assert ha["layer2.0.conv2"] == hb["layer2.0.conv2"]
    assert ha["layer3.0.conv1"] == hb["layer3.0.conv1"]
    assert ha["layer3.0.conv2"] != hb["layer3.0.conv2"]
    assert ha["fc"] != hb["fc"]
    assert a.structural_hash() != b.structural_hash()


# ---- uids -----------------------------------------------------------------------------------


def _uids(graph: Graph) -> dict[str, int]:
    return {n.name: n.uid for n in graph.nodes}


def test_uids_survive_copies_and_json():
    graph = traced("inception")
    assert _uids(graph.copy()) == _uids(graph)
    assert _uids(Graph.from_json(graph.to_json())) == _uids(graph)
    assert len(set(_uids(graph).values())) == len(graph)
    copy = graph.copy()  # shares nothing: mutators edit templates and specs in place
    copy["fc"].op.spec["args"][1] = 3
    copy["fc"].meta["edited"] = True
    assert graph["fc"].op.spec["args"][1] == 10 and "edited" not in graph["fc"].meta


def test_uids_survive_edits_of_other_nodes():
    graph = traced("resnet_basic")
    before = _uids(graph)
    relu = graph["relu"]
    maxpool = graph["maxpool"]
    # insert a node between relu and maxpool, edit another node's op, rename a third
    extra = graph.add_node("extra", Operation("function", target="torch:sigmoid",
                                              args=[{"__in__": 0}]))
    graph.connect(relu, extra, 0)
    graph.connect(extra, maxpool, 0)
    fc = graph["fc"]
    graph.set_op(fc, Operation("module", args=[{"__in__": 0}], attr="fc",
                               spec={"cls": "torch.nn.modules.linear:Linear",
                                     "args": [32, 3], "kwargs": {}}))
    graph.rename(graph["layer1.0.conv1"], "first_conv")
    graph.lint()
    after = _uids(graph)
    assert after.pop("extra") not in before.values()
    assert after.pop("first_conv") == before.pop("layer1.0.conv1")
    assert after == before
    # removing it again and adding another node never reuses a uid, also after a reload
    graph.connect(relu, maxpool, 0)
    graph.remove_node(extra)
    graph.lint()
    reloaded = Graph.from_json(graph.to_json())
    new = reloaded.add_node("new", Operation("function", target="torch:relu",
                                             args=[{"__in__": 0}]))
    assert new.uid not in set(before.values()) | {extra.uid}
    out = graph.to_module()(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 3)


def _fresh_order(graph: Graph) -> list[int]:
    """The topological order computed from scratch (a copy has no cached order)."""
    return [n.uid for n in graph.copy().nodes]


@pytest.mark.parametrize("name", ["inception", "resnet_basic", "densenet"])
def test_edge_queries_agree_with_networkx(name):
    import networkx as nx

    graph = traced(name)
    ref = nx.MultiDiGraph()
    ref.add_nodes_from(n["uid"] for n in graph.to_data()["nodes"])
    ref.add_edges_from((s, d, p) for s, d, p in graph.to_data()["edges"])
    assert sorted((s.uid, d.uid, p) for s, d, p in graph.edges()) == sorted(ref.edges(keys=True))
    assert set(graph.uids()) == set(ref)
    nodes = graph.nodes
    for node in nodes:
        assert sorted((d.uid, p) for d, p in graph.out_edges(node)) == \
            sorted((d, p) for _, d, p in ref.out_edges(node.uid, keys=True))
        assert graph.descendant_uids(node) == nx.descendants(ref, node.uid)
        assert graph.ancestor_uids(node) == nx.ancestors(ref, node.uid)
    for a in nodes[::5]:
        for b in nodes[::3]:
            assert graph.reaches(a, b) == nx.has_path(ref, a.uid, b.uid), (a, b)


class _TwoWays(nn.Module):
    def forward(self, x):
        a, b, c = torch.relu(x), torch.sigmoid(x), torch.tanh(x)
        return torch.cat([a, b], dim=1), c


def test_port_edits_keep_template_edges_and_order_in_sync():
    graph = retiarii.trace(_TwoWays())
    cat = graph["cat"]
    late = graph.add_node("late", Operation("function", target="torch:exp",
                                            args=[{"__in__": 0}]))
    graph.connect(graph["x"], late, 0)
    assert graph.append_port(cat, in_list=True) == 2
    assert cat.op.args[0] == [{"__in__": 0}, {"__in__": 1}, {"__in__": 2}]
    graph.connect(late, cat, 2)
    assert [n.uid for n in graph.nodes] == _fresh_order(graph)
    graph.lint()
    x = torch.randn(2, 3)
    assert torch.equal(graph.to_module()(x)[0],
                       torch.cat([torch.relu(x), torch.sigmoid(x), torch.exp(x)], dim=1))
    graph.remove_port(cat, 0)  # relu's edge goes, sigmoid and exp move down one port
    assert cat.op.args[0] == [{"__in__": 0}, {"__in__": 1}]
    assert graph.ports_between(graph["sigmoid"], cat) == [0]
    assert graph.ports_between(late, cat) == [1]
    assert graph["relu"].users == [] and graph.out_edges(late) == [(cat, 1)]
    assert [n.uid for n in graph.nodes] == _fresh_order(graph)
    graph.lint()
    assert torch.equal(graph.to_module()(x)[0], torch.cat([torch.sigmoid(x), torch.exp(x)], 1))
    graph.append_port(graph["output"])  # a plain template grows its argument list
    assert graph["output"].op.args[-1] == {"__in__": 2} and graph["output"].inputs[2] is None


# ---- lint catches every broken invariant ----------------------------------------------------


def _lint_error(graph: Graph) -> str:
    with pytest.raises(GraphError) as info:
        graph.lint()
    return str(info.value)


def test_lint_catches_a_cycle():
    graph = traced("mlp_dropout")
    graph.connect(graph["out"], graph["body.0"], 0)  # feed the head back into the first layer
    assert "cycle" in _lint_error(graph)
    with pytest.raises(GraphError, match="cycle"):
        graph.to_module()


def test_lint_catches_dangling_and_doubly_fed_ports():
    graph = traced("resnet_basic")
    graph.disconnect_port(graph["layer1.0.add"], 1)
    msg = _lint_error(graph)
    assert "'layer1.0.add'" in msg and "input port 1 has 0 edges" in msg
    with pytest.raises(GraphError, match="dangling"):
        graph.to_module()
    data = traced("resnet_basic").to_data()
    add = next(n["uid"] for n in data["nodes"] if n["name"] == "layer1.0.add")
    data["edges"].append([0, add, 0])  # a second edge into a fed port
    assert "input port 0 has 2 edges" in _lint_error(Graph.from_data(data))


def test_lint_catches_an_edge_into_a_port_the_op_does_not_read():
    graph = traced("mlp_dropout")
    graph.connect(graph["x"], graph["out"], 3)
    assert "enters port 3" in _lint_error(graph)


def test_duplicate_names_are_caught():
    data = traced("mlp_dropout").to_data()
    data["nodes"][2]["name"] = data["nodes"][1]["name"]
    with pytest.raises(GraphError, match="already exists"):
        Graph.from_data(data)
    graph = traced("mlp_dropout")
    graph["body.1"].name = "body.0"  # bypassing rename() breaks the name index
    assert "name index out of sync" in _lint_error(graph)
    with pytest.raises(GraphError, match="already exists"):
        graph.rename(graph["out"], "body.0")
    data = traced("mlp_dropout").to_data()
    data["nodes"][2]["uid"] = data["nodes"][1]["uid"]
    with pytest.raises(GraphError, match="already used"):
        Graph.from_data(data)


def test_lint_catches_unimportable_and_unconstructible_ops():
    graph = traced("mlp_dropout")
    graph.set_op(graph["log_softmax"], Operation("function", target="torch:no_such_function",
                                                  args=[{"__in__": 0}]))
    msg = _lint_error(graph)
    assert "'log_softmax'" in msg and "no_such_function" in msg
    graph = traced("mlp_dropout")
    op = graph["out"].op.copy()
    op.spec["cls"] = "no_such_package.layers:Linear"
    graph.set_op(graph["out"], op)
    msg = _lint_error(graph)
    assert "'out'" in msg and "no_such_package" in msg
    graph = traced("mlp_dropout")
    op = graph["out"].op.copy()
    op.spec["args"] = ["sixteen", 5]  # the constructor rejects it
    graph.set_op(graph["out"], op)
    assert "not re-creatable" in _lint_error(graph)
    graph.lint(deep=False)  # shallow lint only checks imports and values


def test_lint_catches_structure_errors():
    graph = traced("mlp_dropout")
    graph.add_node("output2", Operation("output", args=[None]))
    assert "exactly one output" in _lint_error(graph)
    graph = traced("tied_lm")
    op = Operation("param", attr="proj.extra",
                   spec={"shape": [1], "dtype": "float32", "buffer": True})
    graph.add_node("proj.extra", op)
    assert "module 'proj' has no parameter or buffer 'extra'" in _lint_error(graph)
    graph = traced("tied_lm")  # the tied weight read with a wrong shape
    op = graph["embed.weight"].op.copy()
    op.spec["shape"] = [8, 30]
    graph.set_op(graph["embed.weight"], op)
    assert "differs from 'weight'" in _lint_error(graph)
    graph = traced("tied_lm")
    graph.add_node("proj.inner", Operation("module", args=[], attr="proj.inner",
                                           spec={"cls": "torch.nn:ReLU"}))
    assert "module path 'proj.inner' lies inside the module 'proj'" in _lint_error(graph)
    graph = traced("resnet_basic")  # one module attribute, two different specs
    op = graph["layer1.0.relu@1"].op.copy()
    op.spec["kwargs"] = {}
    graph.set_op(graph["layer1.0.relu@1"], op)
    assert "module specs differ" in _lint_error(graph)


# ---- bad input: models fx cannot trace -------------------------------------------------------


class _DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # BRANCH ON A VALUE
            return x.relu()
        return -x


class _IteratesTensor(nn.Module):
    def forward(self, x):
        return torch.stack([row * 2 for row in x])  # ITERATES A TENSOR


class _Net(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.layer1 = nn.Sequential(block, nn.ReLU())

    def forward(self, x):
        return self.layer1(self.stem(x))


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "_line_of" not in line)


@pytest.mark.parametrize("block, marker", [(_DataDependent, "BRANCH ON A VALUE"),
                                           (_IteratesTensor, "ITERATES A TENSOR")])
def test_untraceable_module_names_path_line_and_fix(block, marker):
    model = _Net(block())
    with pytest.raises(TraceError) as info:
        retiarii.trace(model)
    msg = str(info.value)
    assert "'layer1.0'" in msg and block.__name__ in msg
    assert f"{__file__}:{_line_of(marker)}" in msg and marker in msg
    assert "leaf" in msg and "concrete_args" in msg
    # the suggested fix works: the block becomes one opaque node, outputs unchanged
    graph = retiarii.trace(model, leaf_modules=[block])
    graph.lint()
    module = graph.to_module()
    module.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    assert torch.equal(module(x), model(x))


class _TopLevelBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        x = self.fc(x)
        if x.sum() > 0:  # THE TOP LEVEL BRANCHES
            return x.relu()
        return -x


class _Branch(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x.relu()
        return -x


class _TopLevelFixed(nn.Module):
    """_TopLevelBranch as the error message says to write it: the branch in a leaf submodule."""

    def __init__(self):
        super().__init__()
        self.fc, self.branch = nn.Linear(4, 4), _Branch()

    def forward(self, x):
        return self.branch(self.fc(x))


def test_a_top_level_branch_is_told_to_move_into_a_leaf_submodule():
    with pytest.raises(TraceError) as info:
        retiarii.trace(_TopLevelBranch())
    msg = str(info.value)
    assert "the top-level module (_TopLevelBranch)" in msg
    assert f"{__file__}:{_line_of('THE TOP LEVEL BRANCHES')}" in msg
    assert "move that code into a submodule" in msg and "@retiarii.leaf" in msg
    # what it says works: the branch in a submodule traced as a leaf, outputs unchanged
    model = _TopLevelFixed()
    graph = retiarii.trace(model, leaf_modules=[_Branch])
    module = graph.to_module()
    module.load_state_dict(model.state_dict())
    for x in (torch.randn(3, 4), -torch.ones(3, 4) * 5):
        assert torch.equal(module(x), model(x))


def test_branch_on_argument_is_fixed_by_concrete_args():
    model = zoo.Flagged()
    with pytest.raises(TraceError, match="concrete_args"):
        retiarii.trace(model)
    x = torch.randn(3, 6)
    for flag in (True, False):
        graph = retiarii.trace(model, concrete_args={"return_features": flag})
        graph.lint()
        assert [n.op.target for n in graph.input_nodes] == ["x", "return_features"]
        module = Graph.from_json(graph.to_json()).to_module()
        module.load_state_dict(model.state_dict())
        # the traced value is the default, and the argument keeps its name
        assert_same(model(x, flag), module(x))
        assert_same(model(x, flag), module(x, return_features=flag))
        with pytest.raises(AssertionError, match="specialized"):
            module(x, not flag)
        ns: dict = {}
        exec(graph.to_source("Exported"), ns)
        exported = ns["Exported"]()
        exported.load_state_dict(model.state_dict())
        assert_same(model(x, flag), exported(x))


class _UnreadableBlock(nn.Module):
    """Its constructor argument is stored nowhere, so it cannot be read back."""

    def __init__(self, hidden: int):
        super().__init__()
        self.inner = nn.Linear(4, hidden)

    def forward(self, x):
        return self.inner(x)


def test_leaf_without_recordable_arguments_fails_at_trace_time():
    model = nn.Sequential(nn.Linear(3, 3), Activation(lambda t: t * 2))
    with pytest.raises(TraceError) as info:
        retiarii.trace(model)
    msg = str(info.value)
    assert "'1'" in msg and "Activation" in msg and "cannot be recorded" in msg
    assert "module level" in msg  # the fix: a module-level function, not a lambda
    model = nn.Sequential(nn.Linear(4, 4), _UnreadableBlock(6))
    with pytest.raises(TraceError) as info:
        retiarii.trace(model, leaf_modules=[_UnreadableBlock])
    msg = str(info.value)
    assert "_UnreadableBlock" in msg and "@retiarii.leaf" in msg
    # a module-level function is recorded and re-created
    graph = retiarii.trace(nn.Sequential(nn.Linear(3, 3), Activation(torch.tanh)))
    assert graph["1"].op.spec["args"] == [{"__ref__": "torch:tanh"}]


def test_leaf_spec_records_constructor_arguments():
    graph = traced("leaf_modules")
    assert graph["gated"].op.spec == {"cls": "zoo_leaf:GatedConv", "args": [6],
                                      "kwargs": {"kernel_size": 3, "mode": "sigmoid"}}
    assert graph["scaler"].op.spec == {"cls": "zoo_leaf:Scaler", "args": [6],
                                       "kwargs": {"init": 0.5}}


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_transformer_stacks_are_recreated_from_their_layers(stack):
    """nn.TransformerEncoder/Decoder keep copies of the layer they were given, not the
    argument: the spec re-creates it from the first copy, final norm included."""
    from retiarii.modspec import build_module, module_spec

    if stack == "encoder":
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        module = nn.TransformerEncoder(layer, 3, norm=nn.LayerNorm(8), enable_nested_tensor=False)
    else:
        layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.1, norm_first=True)
        module = nn.TransformerDecoder(layer, 2)
    spec = json.loads(json.dumps(module_spec(module)))
    rebuilt = build_module(spec)
    assert repr(rebuilt) == repr(module) and len(rebuilt.layers) == len(module.layers)
    rebuilt.load_state_dict(module.state_dict())  # same names and shapes
    module.eval()
    rebuilt.eval()
    x = torch.randn(2, 5, 8) if stack == "encoder" else torch.randn(5, 2, 8)
    args = (x,) if stack == "encoder" else (x, torch.randn(4, 2, 8))
    assert torch.equal(rebuilt(*args), module(*args))


# ---- bad input: corrupt JSON, newer schema ----------------------------------------------------


def test_corrupt_json_is_a_clear_error():
    text = traced("two_tower").to_json()
    with pytest.raises(GraphError, match="does not parse"):
        Graph.from_json(text[: len(text) // 2])
    with pytest.raises(GraphError, match="not a retiarii graph"):
        Graph.from_json("[1, 2]")
    data = json.loads(text)
    del data["nodes"]
    with pytest.raises(GraphError, match='"nodes" must be a list'):
        Graph.from_data(data)
    data = json.loads(text)
    data["nodes"][3]["op"]["kind"] = "teleport"
    with pytest.raises(GraphError, match=r"node #3 .*'teleport'"):
        Graph.from_data(data)
    data = json.loads(text)
    data["edges"][0] = [0, 999, 0]
    with pytest.raises(GraphError, match="does not exist"):
        Graph.from_data(data)
    data = json.loads(text)
    data["edges"][1][2] = "zero"
    with pytest.raises(GraphError, match="edge #1"):
        Graph.from_data(data)
    data = json.loads(text)  # a value tag that does not exist: lint names the node
    node = next(n for n in data["nodes"] if n["op"]["kind"] == "function")
    node["op"]["args"].append({"__bogus__": 1})
    msg = _lint_error(Graph.from_data(data))
    assert repr(node["name"]) in msg and "__bogus__" in msg


@pytest.mark.parametrize("version, match", [(2, "schema version 2.*Upgrade retiarii"),
                                            (99, "schema version 99"),
                                            ("1", "invalid schema version"),
                                            (None, "invalid schema version")])
def test_other_schema_versions_are_refused(version, match):
    data = traced("mlp_dropout").to_data()
    data["version"] = version
    with pytest.raises(GraphError, match=match):
        Graph.from_data(data)


def _json_paths(data, path=()):
    yield path
    items = data.items() if isinstance(data, dict) else \
        enumerate(data) if isinstance(data, list) else ()
    for k, v in items:
        yield from _json_paths(v, path + (k,))


_JUNK = [None, 0, -1, 7, 1.5, True, "x", [], {}, [1, 2], {"__in__": 99}, {"__bogus__": 1},
         {"__in__": "0"}, {"kind": "module"}, {"__slice__": [1]}]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["two_tower", "shape_ops", "vit"]), st.randoms(use_true_random=False),
       st.sampled_from(_JUNK), st.booleans())
def test_any_corruption_fails_with_graph_error_or_still_works(name, rnd, junk, delete):
    """Load + lint either raise GraphError or give a graph that codegen turns into code."""
    data = json.loads(traced_json(name))
    path = rnd.choice(list(_json_paths(data))[1:])
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = junk
    try:
        graph = Graph.from_data(data)
        graph.lint()
    except GraphError:
        return
    graph.to_module()
    compile(graph.to_source(), "exported.py", "exec")


# ---- random programs: trace -> JSON -> to_module equals the original --------------------------

_UNARY = ["relu", "tanh", "neg", "sigmoid", "softmax", "scale", "transpose2", "view", "linear",
          "norm", "dropout", "param"]
_BINARY = ["add", "mul", "sub", "maximum", "cat_split"]


class _Program(nn.Module):
    """Interprets a list of instructions; fx traces straight through the Python loop."""

    def __init__(self, program: list, dim: int):
        super().__init__()
        self.program = program
        self.mods = nn.ModuleList()
        self.params = nn.ParameterList()
        for op, _ in program:
            if op == "linear":
                self.mods.append(nn.Linear(dim, dim))
            elif op == "norm":
                self.mods.append(nn.LayerNorm(dim))
            elif op == "dropout":
                self.mods.append(nn.Dropout(0.3))
            elif op == "param":
                self.params.append(nn.Parameter(torch.randn(dim)))

    def forward(self, x):
        values = [x]
        mods, params = iter(self.mods), iter(self.params)
        for op, arg in self.program:
            v, other = values[-1], values[arg % len(values)]
            if op == "relu":
                v = torch.relu(v)
            elif op == "tanh":
                v = v.tanh()
            elif op == "neg":
                v = -v
            elif op == "sigmoid":
                v = F.sigmoid(v)
            elif op == "softmax":
                v = v.softmax(dim=-1)
            elif op == "scale":
                v = v * 0.5 + 1
            elif op == "transpose2":
                v = v.transpose(0, 1).contiguous().transpose(0, 1)
            elif op == "view":
                v = v.view(v.size(0), -1).view(v.shape)
            elif op in ("linear", "norm", "dropout"):
                v = next(mods)(v)
            elif op == "param":
                v = v * next(params)
            elif op == "add":
                v = v + other
            elif op == "mul":
                v = torch.mul(v, other)
            elif op == "sub":
                v = v - other
            elif op == "maximum":
                v = torch.maximum(v, other)
            elif op == "cat_split":
                v = torch.cat([v, other], dim=-1)[..., : v.shape[-1]]
            values.append(v)
        return {"last": values[-1], "pair": (values[len(values) // 2], values[1])}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_UNARY + _BINARY), st.integers(0, 50)),
                min_size=1, max_size=12))
def test_random_programs_round_trip(program):
    torch.manual_seed(0)
    model = _Program(program, dim=6)
    graph = retiarii.trace(model)
    graph.lint()
    text = graph.to_json()
    again = Graph.from_json(text)
    assert again.to_json() == text and again.structural_hash() == graph.structural_hash()
    module = again.to_module()
    assert list(module.state_dict()) == list(model.state_dict())
    module.load_state_dict(model.state_dict())
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(7))
    assert_same(run_modes(model, lambda: (x,)), run_modes(module, lambda: (x,)))
    ns: dict = {}
    exec(again.to_source("Exported"), ns)
    exported = ns["Exported"]()
    exported.load_state_dict(model.state_dict())
    assert_same(run_modes(model, lambda: (x,)), run_modes(exported, lambda: (x,)))


def test_every_zoo_family_is_present():
    families = {"resnet_basic", "resnet_bottleneck", "mobilenet_v2", "shufflenet_v2",
                "inception", "densenet", "squeezenet", "efficientnet_se", "vit",
                "lstm_classifier", "gru_classifier", "unet", "darts_cell", "mlp_dropout"}
    assert families <= set(CASES)
    assert len(CASES) >= 12


# ---- walking encoded data (codec.find_tags / map_tags) ----------------------------------------

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=3))
_encoded = st.recursive(
    st.one_of(_scalars, st.builds(lambda k: {"__in__": k}, st.integers(0, 4))),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.builds(lambda v: {"__tuple__": v}, st.lists(inner, max_size=3)),
        st.dictionaries(st.sampled_from(["dim", "stride", "x"]), inner, max_size=3)),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(_encoded)
def test_tag_walkers_find_map_and_drop(data):
    from retiarii.codec import DROP, find_tags, map_tags

    ports = find_tags(data, "__in__")
    assert json.dumps(map_tags(data, "__in__", lambda k: {"__in__": k})) == json.dumps(data)
    assert find_tags(map_tags(data, "__in__", lambda k: {"__in__": k + 1}), "__in__") == \
        [k + 1 for k in ports]
    # dropping port 0 removes it from lists; elsewhere (a dict value) the tag stays
    dropped = map_tags(data, "__in__", lambda k: DROP if k == 0 else {"__in__": k})
    assert DROP not in find_tags(dropped, "__in__")
    kept = find_tags(dropped, "__in__")
    assert [k for k in kept if k != 0] == [k for k in ports if k != 0]
    assert len(kept) <= len(ports)
    if not isinstance(data, list):
        assert find_tags([data], "__in__") == ports
