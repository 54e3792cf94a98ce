"""The interpreter base (retiarii/interpreter.py) that shape analyses and code generation share.

References: the original model (running a traced graph node by node with the model's own
layers computes its outputs bit for bit), torch.fx's ShapeProp over the emitted module (the
shapes the mutators read, computed on the meta device, are the real ones), and the emitted
module itself (a cell runs as its emitted GraphModule does).
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

import retiarii
import zoo
from retiarii import Graph, Operation
from retiarii.interpreter import Interpreter
from retiarii.mutators._common import node_shapes

CASES = {c.name: c for c in zoo.cases()}


def _same(expected, got) -> bool:
    if isinstance(expected, torch.Tensor):
        return isinstance(got, torch.Tensor) and expected.dtype == got.dtype \
            and torch.equal(expected, got)
    if isinstance(expected, (list, tuple)):
        return type(got) is type(expected) and len(got) == len(expected) \
            and all(_same(e, g) for e, g in zip(expected, got))
    if isinstance(expected, dict):
        return isinstance(got, dict) and list(got) == list(expected) \
            and all(_same(expected[k], got[k]) for k in expected)
    return got == expected


class _WithModelWeights(Interpreter):
    """Runs a traced graph with the original model's own layers and tensors."""

    def __init__(self, graph: Graph, model: nn.Module):
        super().__init__(graph)
        self.model = model

    def get_module(self, node):
        return self.model.get_submodule(node.attr)

    def on_param(self, node, inputs):
        return functools.reduce(getattr, node.attr.split("."), self.model)


@pytest.mark.parametrize("name", CASES)
def test_running_the_nodes_computes_what_the_original_computes(name):
    case = CASES[name]
    model = case.build().eval()
    graph = retiarii.trace(model, **case.trace_kwargs)
    inputs = case.inputs()
    with torch.no_grad():
        assert _same(model(*inputs), _WithModelWeights(graph, model).run(*inputs))


# Models the meta device cannot run to the end: node_shapes then reports the nodes before the
# failure. dict_io's tensors sit inside a dict (only top-level inputs move to the meta device);
# leaf_modules calls .item().
_PARTIAL_ON_META = {"dict_io", "leaf_modules"}


@pytest.mark.parametrize("name", [n for n in CASES if n != "resnet50"])  # (resnet50: time)
def test_meta_device_shapes_agree_with_fx_shape_prop(name):
    case = CASES[name]
    graph = retiarii.trace(case.build(), **case.trace_kwargs)
    gm = graph.to_module().eval()
    inputs = case.inputs()
    with torch.no_grad():
        ShapeProp(gm).propagate(*inputs)
    expected = {n.meta["retiarii_uid"]: list(n.meta["tensor_meta"].shape)
                for n in gm.graph.nodes
                if isinstance(n.meta.get("tensor_meta"), TensorMetadata)}
    assert expected, "the model computes tensors"
    shapes = node_shapes(graph, inputs)
    assert shapes, "at least the inputs have shapes"
    reported = {uid: shapes[uid] for uid in expected if uid in shapes}
    assert reported == {uid: expected[uid] for uid in reported}
    if name not in _PARTIAL_ON_META:
        assert reported == expected


class _Cell(nn.Module):
    def forward(self, a, b):
        return torch.sigmoid(a) * torch.relu(b)


class _Outer(nn.Module):
    def forward(self, x, scale: float = 2.0):
        return torch.tanh(x) * scale


def _graph_with_a_cell() -> Graph:
    graph = retiarii.trace(_Outer())
    tanh = graph["tanh"]
    cell = graph.add_node("cell", Operation("subgraph", graph=retiarii.trace(_Cell()),
                                            args=[{"__in__": 0}, {"__in__": 1}], attr="cell"))
    graph.connect(tanh, cell, 0)
    graph.connect(graph["x"], cell, 1)
    graph.connect(cell, graph["mul"], 0)
    graph.lint()
    return graph


def test_a_cell_runs_as_its_emitted_module_and_inputs_take_defaults():
    graph = _graph_with_a_cell()
    x = torch.randn(3, 4)
    expected = torch.sigmoid(torch.tanh(x)) * torch.relu(x) * 2.0
    assert torch.equal(graph.to_module()(x), expected)
    assert torch.equal(Interpreter(graph).run(x), expected)
    assert torch.equal(Interpreter(graph).run(x, 3.0), expected / 2.0 * 3.0)
    assert torch.equal(Interpreter(graph).run(x=x, scale=3.0), expected / 2.0 * 3.0)
    with pytest.raises(TypeError, match="'x' was not given"):
        Interpreter(graph).run()


def test_a_subclass_overrides_one_node_kind():
    class NoTanh(Interpreter):
        def on_function(self, node, inputs):
            if node.op.target == "torch:tanh":
                return inputs[0]
            return super().on_function(node, inputs)

    graph = _graph_with_a_cell()
    x = torch.randn(3, 4)
    # the cell is run by a plain Interpreter: the override applies to this graph's nodes
    assert torch.equal(NoTanh(graph).run(x), torch.sigmoid(x) * torch.relu(x) * 2.0)


def test_a_dangling_port_names_the_node():
    graph = _graph_with_a_cell()
    graph.disconnect_port(graph["cell"], 1)
    with pytest.raises(retiarii.GraphError, match="'cell' has a dangling input port 1"):
        Interpreter(graph).run(torch.randn(2))
