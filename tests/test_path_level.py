"""Path-level NAS (Cai et al., ICML 2018): the DenseNet-BC base, the tree cell's transformations,
and their function-preserving property (replication-add, split-concat, a node inserted with an
identity edge, a new edge's convolution identity-initialised); a new edge's pooling cannot be
the identity and changes the function."""
from __future__ import annotations

import pytest
import torch

from model_spaces import path_level as pl
from model_spaces import path_tree as pt
from retiarii import nas
from retiarii.strategies.multi_trial.path_level_rl import to_sample


def _randomize_batchnorm(net: torch.nn.Module, seed: int) -> None:
    """Trained-looking statistics and affine weights: a transfer that dropped or misplaced a
    BatchNorm channel would show in the outputs (fresh ones are all 0 / 1)."""
    g = torch.Generator().manual_seed(seed)
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.rand(n, generator=g) - 0.5)
            m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(n, generator=g) + 0.5)
            m.bias.data.copy_(torch.rand(n, generator=g) - 0.5)


STEPS = [("r", "split", None), ("r.1", "replicate", None), ("r.0", "deepen", None),
         ("r.1.0", "split", None), ("r.0.1", "change_op", "sep_conv_3x3")]


def test_every_transformation_of_a_chain_preserves_the_networks_function():
    space = nas.build_space("path_level", "small")
    torch.manual_seed(0)
    old = space.build(to_sample([]))
    _randomize_batchnorm(old, 0)
    x = torch.randn(4, 1, 8, 8)
    for n, (path, kind, op) in enumerate(STEPS, start=1):
        new = space.build(to_sample(STEPS[:n]))  # the emitted network of the transformed space
        pl.transfer_network(old, new, path, kind)
        old.eval(), new.eval()
        with torch.no_grad():
            before, after = old(x), new(x)
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
        old = new


@pytest.mark.parametrize("op", [p for p in pt.PRIMITIVES if p != "identity"])
def test_a_new_edges_op_is_the_identity_where_it_can_be_and_a_pooling_changes_the_function(op):
    """seq[conv, identity] -> seq[conv, op]: a conv (plain or separable) is identity-initialised
    (its kernel a centred delta, its BatchNorm passing through given its statistics), so the
    cell computes what it did; a pooling has no such setting and pools what the identity
    passed."""
    torch.manual_seed(0)
    deep = pt.apply(pl.BASE_CELL, "r", "deepen", 6)
    old = pt.Tree(deep, 5, 6)
    _randomize_batchnorm(old, 2)
    new = pt.Tree(pt.apply(deep, "r.1", "change_op", 6, op), 5, 6)
    _randomize_batchnorm(new, 3)  # the new edge's own statistics: the init must use them
    pt.transfer(old, new, "r.1", "change_op")
    old.eval(), new.eval()
    x = torch.randn(4, 5, 8, 8)
    with torch.no_grad():
        before, after = old(x), new(x)
        if op.endswith("pool_3x3"):
            assert not list(new.parts[1].parameters())  # nothing to set
            assert not pt.identity_init(new.parts[1].parts[0])
            assert not torch.allclose(after, before, atol=1e-3)
            torch.testing.assert_close(after, pt.PathOp(op, 6, 6)(before))
        else:
            torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
            # with fresh weights instead (no transfer) the function changes: the test can fail
            fresh = pt.Tree(pt.apply(deep, "r.1", "change_op", 6, op), 5, 6).eval()
            fresh.parts[0].load_state_dict(old.parts[0].state_dict())
            assert not torch.allclose(fresh(x), before, atol=1e-3)


def test_identity_init_refuses_an_op_that_changes_the_width():
    with pytest.raises(ValueError, match="keeps its width"):
        pt.identity_init(pt.PathOp("conv_3x3", 4, 6))


def test_split_divides_the_filters_and_their_batchnorm_channels_in_order():
    old = pt.Tree(["op", "conv_3x3"], 4, 5)
    _randomize_batchnorm(old, 1)
    new = pt.Tree(pt.apply(["op", "conv_3x3"], "r", "split", 5), 4, 5)
    pt.transfer(old, new, "r", "split")
    w = old.parts[0].op[0].weight  # (5, 4, 3, 3)
    a, b = new.parts[0].parts[0].op[0].weight, new.parts[1].parts[0].op[0].weight
    assert (a.shape[0], b.shape[0]) == (3, 2)  # split_sizes(5, 2)
    assert torch.equal(torch.cat([a, b]), w)
    mean = old.parts[0].op[1].running_mean
    assert torch.equal(torch.cat([new.parts[i].parts[0].op[1].running_mean for i in (0, 1)]),
                       mean)


def test_the_transformations_apply_where_the_paper_defines_them():
    tree = pl.BASE_CELL
    assert pt.kinds(tree, "r", 8) == ["replicate", "split", "deepen"]  # no op change: a conv
    assert pt.kinds(tree, "r", 1) == ["replicate", "deepen"]  # one filter: no split
    tree = pt.apply(tree, "r", "deepen", 8)
    assert tree == ["seq", [["op", "conv_3x3"], ["op", "identity"]]]
    assert pt.kinds(tree, "r.1", 8) == ["replicate", "deepen", "change_op"]  # an identity
    assert list(pt.nodes(tree)) == ["r", "r.0", "r.1"]
    with pytest.raises(ValueError, match="change_op does not apply"):
        pt.apply(tree, "r.0", "change_op", 8, "conv_1x1")


def test_every_layer_shares_the_cell_and_the_row_runs_rl_over_the_transformations():
    from retiarii.strategies import PolicyBasedRL

    space = nas.build_space("path_level", "small")
    model = space.instantiate(to_sample(STEPS[:2]))
    cells = [n.op.spec["args"] for n in model.graph.nodes
             if n.kind == "module" and n.op.spec and n.op.spec["cls"].endswith(":Cell")]
    assert len(cells) == 4 and all(c[0] == cells[0][0] for c in cells)  # one structure
    assert cells[0][0] == ["concat", [["op", "conv_3x3"], ["add", [["op", "conv_3x3"]] * 2]]]
    rl = nas.strategy("path_level", seed=0)
    assert isinstance(rl, PolicyBasedRL)
    labels = set()
    for _ in range(6):
        sample = rl.ask(space)
        labels |= {k.rstrip("0123456789") for k in sample}
        rl.tell(sample, 0.5)
    assert labels <= {"path/grow", "path/node", "path/kind", "path/op"}
