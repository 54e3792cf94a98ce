"""Modules torch.fx cannot trace, given to mutators or inline choices: kept as one opaque node
(shapes checked, rebuilt from JSON, exported); targets naming composite modules get a hint."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import retiarii as rt
from retiarii.mutators import OperatorMutator
from test_space import Base  # the paper's base chain: conv -> relu -> maxpool -> dense
from untraceable import Gate, Hidden, LoopMerge

HERE = Path(__file__).resolve().parent
X = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))




class Inception(rt.Mutator):
    """The paper's example with the user's own merge module instead of rt.ops.Sum."""

    def __init__(self, merge=LoopMerge, width=8):
        super().__init__()
        self.merge, self.width = merge, width

    def mutate(self, targets):
        relu, pool, flat = targets
        n = self.choose([2, 3], label="paths")
        self.delete_node(pool)
        merge = self.create_node("merge", self.merge())
        for i in range(n):
            op = self.choose({"conv": nn.Conv2d(8, self.width, 3, padding=1),
                              "pool": nn.MaxPool2d(3, 1, 1)}, label=f"op{i}")
            path = self.create_node(f"path{i}", op)
            self.connect(relu, path)
            self.connect(path, merge)
        self.connect(merge, flat)


def test_untraceable_merge_is_one_opaque_node_that_runs_rebuilds_and_exports(tmp_path):
    with pytest.raises(rt.TraceError):  # fx itself cannot trace it
        rt.trace(LoopMerge())
    space = rt.ModelSpace(Base(), [rt.apply_mutator(["relu", "pool", "flat"], Inception())],
                          example_input=X)
    assert space.size() == 4 + 8
    sample = {"paths": 3, "op0": "conv", "op1": "pool", "op2": "conv"}
    model = space.instantiate(sample)
    merge = model.graph["merge"]
    assert merge.kind == "module" and merge.op.spec == {"cls": "untraceable:LoopMerge",
                                                         "args": [], "kwargs": {}}
    assert [n.name for n in merge.inputs] == ["path0", "path1", "path2"]
    model.graph.lint()
    assert merge.meta["shape"] == [2, 8, 8, 8]  # the shape check ran it

    # A worker rebuilds it from JSON alone, referring to the class as for @rt.leaf modules.
    net = model.to_module().eval()
    rebuilt = rt.Graph.from_json(model.graph.to_json()).to_module().eval()
    rebuilt.load_state_dict(net.state_dict())
    with torch.no_grad():
        assert torch.equal(net(X), rebuilt(X))
        reference = net.dense(net.flat(LoopMerge()(
            net.path0(net.relu(net.conv(X))), net.path1(net.relu(net.conv(X))),
            net.path2(net.relu(net.conv(X))))))
    assert torch.equal(net(X), reference)

    # The export imports the class from where it is defined and runs without retiarii.
    (tmp_path / "exported.py").write_text(model.graph.to_source("Exported"))
    torch.save(net.state_dict(), tmp_path / "w.pt")
    torch.save(X, tmp_path / "x.pt")
    torch.save(net(X).detach(), tmp_path / "y.pt")
    script = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import torch, exported\n"
              "m = exported.Exported().eval(); m.load_state_dict(torch.load('w.pt'))\n"
              "assert 'retiarii' not in sys.modules\n"
              "assert torch.equal(m(torch.load('x.pt')), torch.load('y.pt'))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "from untraceable import LoopMerge" in model.graph.to_source("Exported")


def test_opaque_node_still_has_its_shapes_checked():
    space = rt.ModelSpace(Base(), [rt.apply_mutator(["relu", "pool", "flat"],
                                                    Inception(width=4))], example_input=X)
    # paths of 4 and of 8 channels cannot be added: the merge itself fails, and says so
    with pytest.raises(rt.ShapeMismatchError) as err:
        space.instantiate({"paths": 2, "op0": "conv", "op1": "pool"})
    assert err.value.node == "merge"
    assert err.value.actual == [[2, 4, 8, 8], [2, 8, 8, 8]]


def test_untraceable_candidates_of_replace_and_layer_choice_are_opaque():
    space = rt.ModelSpace(Base(), [rt.apply_mutator("relu", OperatorMutator(
        {"relu": nn.ReLU(), "gate": Gate(8, scale=3.0)}, label="act", shared=True))],
        example_input=X)
    model = space.instantiate({"act": "gate"})
    assert model.graph["relu"].op.spec == {"cls": "untraceable:Gate", "args": [8],
                                           "kwargs": {"scale": 3.0}}
    assert model.to_module()(X).shape == (2, 10)

    class Inline(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 8, 3, padding=1)
            self.act = rt.LayerChoice({"relu": nn.ReLU(), "gate": Gate(8)})

        def forward(self, x):
            return self.act(self.conv(x))

    inline = rt.ModelSpace(Inline(), example_input=X)
    assert inline.size() == 2
    model = inline.instantiate({"act": "gate"})
    assert model.graph["act"].op.spec["cls"] == "untraceable:Gate"
    assert model.to_module()(X).shape == (2, 8, 8, 8)


def test_untraceable_candidate_holding_choices_is_not_made_opaque():
    class Chooser(nn.Module):  # kept opaque, its LayerChoice would be silently dropped
        def __init__(self):
            super().__init__()
            self.op = rt.LayerChoice([nn.ReLU(), nn.Tanh()])

        def forward(self, x):
            return self.op(x) if x.sum() > 0 else x

    class Inline(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = rt.LayerChoice({"relu": nn.ReLU(), "chooser": Chooser()})

        def forward(self, x):
            return self.act(x)

    with pytest.raises(rt.TraceError, match="cannot trace"):
        rt.ModelSpace(Inline())


def test_untraceable_module_that_cannot_be_rebuilt_says_how_to_fix_it():
    space = rt.ModelSpace(Base(), [rt.apply_mutator("relu", OperatorMutator([Hidden(8)]))])
    with pytest.raises(rt.MutationError, match=r"Hidden cannot be traced.*@retiarii\.leaf"):
        space.random_sample(0)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.block = Block()

    def forward(self, x):
        return self.block(self.stem(x))


@pytest.mark.parametrize("target", ["block", Block, rt.Chain("stem", "block")])
def test_target_naming_a_composite_module_hints_at_leaf_or_children(target):
    space = rt.ModelSpace(Net(), [rt.apply_mutator(target, OperatorMutator([nn.Identity()]))])
    with pytest.raises(rt.TargetError) as err:
        space.random_sample(0)
    message = str(err.value)
    assert "composite module" in message and "@retiarii.leaf" in message
    if target is not Block:
        assert "block.conv, block.bn" in message and '"block.*"' in message
    # the two fixes the hint names both work
    rt.ModelSpace(Net(), [rt.apply_mutator("block.*", OperatorMutator([nn.Identity()]))]
                  ).random_sample(0)
    leafy = rt.ModelSpace(Net(), [rt.apply_mutator(target, OperatorMutator([nn.Identity()]))],
                          leaf_modules=[Block])
    assert leafy.size() == 1


def test_plain_typo_still_names_the_closest_nodes():
    space = rt.ModelSpace(Net(), [rt.apply_mutator("stemm", OperatorMutator([nn.Identity()]))])
    with pytest.raises(rt.TargetError, match="closest node names: stem"):
        space.random_sample(0)
