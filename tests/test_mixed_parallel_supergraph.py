"""Mixed parallelism on the weight-sharing super-graph (retiarii/optim/supergraph.py): K gloo
ranks, each training its own sampled model of a ModelSpace, equal one process that applies,
per step, each pooled weight's gradient averaged over the models that used it."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import retiarii as rt
from retiarii.engine.executors.local_ranks import RankError, spawn
from retiarii.optim.mixed_parallel import average_used_gradients
from retiarii.optim.supergraph import SuperGraph

TOL = 1e-5  # relative to each tensor's largest magnitude


def _unit(k: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(4, 4, k, padding=k // 2), nn.BatchNorm2d(4), nn.ReLU())


class Blocks(nn.Module):
    """A frozen stem, two blocks choosing conv3 / conv5 / pool, a trained head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # frozen values must be deterministic in every process
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.stem.requires_grad_(False)
        self.blocks = nn.Sequential(*[rt.LayerChoice(
            {"conv3": _unit(3), "conv5": _unit(5), "pool": nn.MaxPool2d(3, 1, 1)},
            label=f"block{i}") for i in range(2)])
        self.head = nn.Linear(4, 3)

    def forward(self, x):  # (B, 1, 8, 8) -> (B, 3)
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def space() -> rt.ModelSpace:
    return rt.ModelSpace(Blocks(), example_input=torch.zeros(1, 1, 8, 8))


# Per step, one sample per rank (K = 3; K = 2 takes the first two): conv5 of block 1 first
# appears in step 1 (the pool grows mid-run), used by rank 2 alone there.
SAMPLES = [[("conv3", "conv3"), ("conv3", "pool"), ("pool", "conv3")],
           [("conv5", "pool"), ("conv3", "conv3"), ("pool", "conv5")],
           [("conv3", "conv5"), ("conv5", "conv5"), ("conv3", "pool")]]


def _sample(pair) -> dict:
    return {"block0": pair[0], "block1": pair[1]}


def _batch(i: int):
    gen = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 1, 8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def _setup():
    sg = SuperGraph(space())
    opt = torch.optim.SGD([{"params": sg.parameters()}], lr=0.1, momentum=0.9)
    sg.attach(opt)
    return sg, opt


def _train_rank(rank: int, world: int, group) -> dict:
    sg, opt = _setup()
    for step, pairs in enumerate(SAMPLES):
        # Every rank builds every rank's path, in rank order: the pools grow alike, so the
        # ranks pass the same parameters to average_used_gradients.
        nets = [sg.path(_sample(p)) for p in pairs[:world]]
        x, y = _batch(step * world + rank)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(nets[rank](x), y).backward()
        average_used_gradients(sg.parameters(), group)
        opt.step()
    return {name: p.detach().clone() for name, p in sg.named_parameters()}


def reference(world: int) -> dict:
    sg, opt = _setup()
    for step, pairs in enumerate(SAMPLES):
        nets = [sg.path(_sample(p)) for p in pairs[:world]]
        params = sg.parameters()
        grads = []
        for r, net in enumerate(nets):
            opt.zero_grad(set_to_none=True)
            x, y = _batch(step * world + r)
            F.cross_entropy(net(x), y).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in params])
        for i, p in enumerate(params):
            used = [g[i] for g in grads if g[i] is not None]
            p.grad = torch.stack(used).mean(0) if used else None
        opt.step()
    return {name: p.detach().clone() for name, p in sg.named_parameters()}


@pytest.mark.parametrize("world", [2, 3])
def test_supergraph_on_ranks_equals_one_process(world):
    want = reference(world)
    for rank, got in enumerate(spawn(_train_rank, world, timeout=120)):
        assert list(got) == list(want), rank
        for name, w in want.items():
            err = ((got[name].double() - w.double()).abs().max()
                   / w.double().abs().max().clamp_min(1e-12)).item()
            assert err <= TOL, f"rank {rank} of {world}: {name} differs by {err:.1e}"
    # the frozen stem kept the base model's values (no rank's gradient touched it)
    stem = [w for w in want.values() if w.dim() == 4 and w.shape[1] == 1]  # (4, 1, 3, 3)
    assert stem and torch.equal(stem[0], Blocks().stem.weight)


def _own_path_only(rank: int, world: int, group) -> None:
    sg, opt = _setup()
    net = sg.path(_sample(SAMPLES[0][rank]))  # rank 1 has no conv unit in block 1: fewer
    F.cross_entropy(net(_batch(rank)[0]), _batch(rank)[1]).backward()
    average_used_gradients(sg.parameters(), group)


def test_ranks_that_built_only_their_own_path_get_a_clear_error():
    with pytest.raises(RankError, match="different parameters on different ranks.*build every "
                                        "rank's path on every rank"):
        spawn(_own_path_only, 2, timeout=120)
