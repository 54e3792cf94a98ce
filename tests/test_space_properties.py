"""Property tests: random samplers on several spaces.

A hypothesis-drawn list of indices drives every choice of a space (index ``i`` modulo the
number of candidates, the first candidate once the list runs out, so open-ended growth stays
bounded). Whatever the draw, a sample either builds, lints and runs, or fails with one of the
documented errors; replaying it rebuilds the same structure; and seeded sampling repeats.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import retiarii as rt
from retiarii.mutators import (AddEdgeMutator, AddNodeMutator, ChangeActivationMutator,
                               InputMutator, InsertingMutator, OperatorMutator)

from model_spaces.nasnet import nasnet_space

DOCUMENTED = (rt.MutationError, rt.ShapeMismatchError, rt.SampleError)
PROPERTY = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = self.relu2(self.conv2(self.relu1(self.conv1(x))))
        return self.fc(torch.flatten(self.pool(self.conv3(x)), 1))


def operators_space() -> rt.ModelSpace:
    """Operator, inserting and input mutators; some candidates change widths (mismatches),
    some are lazy (adapt)."""
    return rt.ModelSpace(ConvNet(), [
        rt.apply_mutator("conv1", InsertingMutator(
            [None, nn.BatchNorm2d(8), nn.LazyConv2d(8, 1), nn.Conv2d(8, 16, 1)])),
        rt.apply_mutator("conv[23]", OperatorMutator(
            [nn.Conv2d(8, 8, 5, padding=2), nn.MaxPool2d(3, 1, 1), nn.LazyConv2d(8, 3, padding=1),
             nn.Conv2d(8, 4, 1), torch.relu])),
        rt.apply_mutator("conv3", InputMutator(["conv1", "relu1", "conv2"], n_chosen=1)),
        rt.apply_mutator("fc", InputMutator(["flatten"])),
    ], example_input=torch.randn(2, 1, 8, 8))


def wann_space() -> rt.ModelSpace:
    """Open-ended growth of a small MLP, as in Weight Agnostic Networks."""
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    return rt.ModelSpace(net, [
        AddNodeMutator([nn.Tanh(), torch.sin, nn.Identity(), nn.LazyLinear(4)], steps=None),
        AddEdgeMutator(steps=None),
        ChangeActivationMutator([nn.ReLU(), nn.Sigmoid(), torch.abs], steps=None),
    ], example_input=torch.randn(2, 4))


def nasnet() -> rt.ModelSpace:
    return nasnet_space(channels=4, num_cells=1, in_channels=1, image_size=8)


def demo() -> rt.ModelSpace:
    """Inline choices (LayerChoice, ValueChoice, Repeat) and a mutator (retiarii.demo)."""
    from retiarii.demo import make_space

    return make_space()


SPACES = {"operators": operators_space, "wann": wann_space, "nasnet": nasnet, "demo": demo}
_BUILT: dict[str, rt.ModelSpace] = {}


def space_of(name: str) -> rt.ModelSpace:
    if name not in _BUILT:
        _BUILT[name] = SPACES[name]()
    return _BUILT[name]


class IndexSampler:
    """Choice ``k`` takes ``indices[k] % len(candidates)``; 0 once the list runs out."""

    def __init__(self, indices: list[int]):
        self.indices = indices
        self.calls = 0

    def choose(self, label, candidates, context) -> int:
        k, self.calls = self.calls, self.calls + 1
        return self.indices[k] % len(candidates) if k < len(self.indices) else 0


def check(space: rt.ModelSpace, indices: list[int]) -> str:
    """Build the model of ``indices`` all the way; return how far it got."""
    try:
        model = space.sample(IndexSampler(indices))
    except DOCUMENTED:
        return "mutation error"
    sample = json.loads(json.dumps(model.sample))  # a sample is JSON: it travels to workers
    assert space.replay(sample).structural_hash() == model.structural_hash()
    try:
        built = space.instantiate(sample)
    except rt.ShapeMismatchError:
        return "shape error"
    built.graph.lint()
    module = built.to_module().eval()
    example = space.example_input
    with torch.no_grad():
        out = module(example)
    assert isinstance(out, torch.Tensor) and out.shape[0] == example.shape[0]
    assert torch.isfinite(out).all()
    return "ran"


@pytest.mark.parametrize("name", sorted(SPACES))
def test_base_choices_build_and_run(name):
    assert check(space_of(name), []) == "ran"


@pytest.mark.parametrize("name", sorted(SPACES))
@PROPERTY
@given(indices=st.lists(st.integers(0, 63), max_size=48))
def test_every_sample_runs_or_raises_a_documented_error(name, indices):
    check(space_of(name), indices)


def test_the_operators_space_reaches_every_outcome():
    """The property above is not vacuous: some draws run, some mismatch shapes."""
    space = space_of("operators")
    outcomes = {check(space, [a, b, c]) for a in range(4) for b in range(5) for c in range(5)}
    assert {"ran", "shape error"} <= outcomes


@pytest.mark.parametrize("name", sorted(SPACES))
@settings(max_examples=10, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_seeded_sampling_repeats(name, seed):
    space = space_of(name)
    first, second = space.random_sample(seed), space.random_sample(seed)
    assert first.sample == second.sample
    assert first.structural_hash() == second.structural_hash()


def test_seeded_samples_are_the_same_in_another_process():
    seeds = [0, 1, 2]
    here = {s: [nasnet().random_sample(s).sample, wann_space().random_sample(s).sample]
            for s in seeds}
    code = ("import json, sys; sys.path.insert(0, sys.argv[1])\n"
            "from test_space_properties import nasnet, wann_space\n"
            "print(json.dumps({s: [nasnet().random_sample(s).sample, "
            "wann_space().random_sample(s).sample] for s in (0, 1, 2)}))")
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)],
                         capture_output=True, text=True, check=True, timeout=120)
    there = {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}
    assert there == {s: json.loads(json.dumps(samples)) for s, samples in here.items()}
