"""Shape propagation (retiarii/shapes.py): the direct run agrees with the reference run (an
fx.Interpreter over the emitted module) on every zoo model, hands over to it whenever it cannot
conclude, and keeps its cache of shared modules bounded."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import retiarii as rt
import zoo
from retiarii import shapes
from retiarii.space import Model

CASES = {c.name: c for c in zoo.cases()}


def _model(case) -> Model:
    graph = rt.trace(case.build(), **case.trace_kwargs)
    return Model(graph, {}, [])


def _shapes(graph) -> dict:
    return {node.name: node.meta.get("shape") for node in graph.nodes}


@pytest.mark.parametrize("name", CASES)
def test_direct_run_records_the_shapes_of_the_reference_run(name):
    case = CASES[name]
    inputs = case.inputs()
    inputs = inputs[0] if len(inputs) == 1 else inputs
    direct, reference = _model(case), _model(case)
    assert shapes._direct_run(direct.graph, inputs) == []  # (no lazy module in the zoo)
    shapes._reference_run(reference, inputs)
    assert _shapes(direct.graph) == _shapes(reference.graph)
    assert any(s is not None for s in _shapes(direct.graph).values())


class OnceOnly(nn.Module):
    """A layer that works only the first time it is called: a module that keeps state across
    calls, which the direct run's shared modules do not give it."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("called twice")
        return x * 2


rt.leaf(OnceOnly)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.once = OnceOnly(4)

    def forward(self, x):
        return self.once(self.fc(x))


def test_a_model_the_direct_run_cannot_check_is_decided_by_the_reference_run(monkeypatch):
    space = rt.ModelSpace(Net(), example_input=torch.zeros(2, 4))
    handed_over = []
    reference = shapes._reference_run
    monkeypatch.setattr(shapes, "_reference_run",
                        lambda *a: (handed_over.append(1), reference(*a))[1])
    first = space.instantiate({})
    assert handed_over == []  # a fresh OnceOnly: the direct run concludes
    second = space.instantiate({})  # the shared OnceOnly fails the direct run ...
    assert handed_over == [1]  # ... and the reference run, with fresh modules, accepts it
    assert _shapes(first.graph) == _shapes(second.graph)


def test_a_real_mismatch_is_reported_by_the_reference_run():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(6, 2)

        def forward(self, x):
            return self.b(self.a(x))

    space = rt.ModelSpace(Bad(), example_input=torch.zeros(2, 4))
    with pytest.raises(rt.ShapeMismatchError, match=r"node 'b': expected 6 features in the "
                                                    r"last dim, got inputs of shape \[\[2, 8\]\]"):
        space.instantiate({})


def test_shared_modules_stay_within_their_bound(monkeypatch):
    monkeypatch.setattr(shapes, "_SHARED", type(shapes._SHARED)())
    monkeypatch.setattr(shapes, "_shared_elements", 0)
    monkeypatch.setattr(shapes, "_SHARED_MAX_ELEMENTS", 1000)
    for width in range(1, 40):
        shapes.shared_module_of({"cls": "torch.nn.modules.linear:Linear", "args": [width, width]})
        assert shapes._shared_elements == sum(size for _, size in shapes._SHARED.values())
        assert shapes._shared_elements <= 1000 or len(shapes._SHARED) == 1
    spec = {"cls": "torch.nn.modules.linear:Linear", "args": [3, 3]}
    assert shapes.shared_module_of(spec) is shapes.shared_module_of(dict(spec))  # a hit
