"""Mixed parallelism (retiarii/optim/mixed_parallel.py, issue #14 item 4) on gloo ranks.

The reference is one process that trains the same super-net on the same samples and batches
and applies, per step, each shared weight's gradient averaged over the models that used it.
The ranks are spawned processes, so the functions they run live at module level here.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from retiarii.engine.executors.local_ranks import RankError, run_segment_on_ranks, spawn
from retiarii.optim.mixed_parallel import _Share, average_used_gradients, size_buckets
from retiarii.strategies.one_shot.base import EvaluatedModel, OneShot, SegmentContext, SegmentResult

TOL = 1e-5  # relative to each tensor's largest magnitude


class TinySuper(nn.Module):
    """A hand-written weight-sharing super-net: a shared stem, two choice layers of three
    candidates each (two of them with BatchNorm), a shared head. ``path`` picks one candidate
    per layer."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.layers = nn.ModuleList(
            nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()),
                           nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                           nn.Sequential(nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8))])
            for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x, path):  # (B, 6) -> (B, 3)
        x = F.relu(self.stem(x))
        for layer, choice in zip(self.layers, path):
            x = layer[choice](x)
        return self.head(x)


def make_net(seed: int = 0) -> TinySuper:
    torch.manual_seed(seed)
    return TinySuper()


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen))
            for _ in range(n)]


# Per step, one path per rank (K = 3; K = 2 takes the first two). Candidate (1, 2) is used by
# no rank in step 0, candidate (0, 2) by rank 2 alone in step 1; every step has shared ones.
PATHS = [[(0, 0), (0, 1), (1, 0)],
         [(1, 1), (1, 0), (2, 0)],
         [(0, 0), (0, 0), (2, 1)],
         [(2, 2), (1, 2), (0, 1)]]


def make_opt(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def _train_rank(rank: int, world: int, group, steps: int) -> dict:
    net, data = make_net(), batches(steps * world)
    opt = make_opt(net)
    net.train()
    for step in range(steps):
        x, y = data[step * world + rank]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x, PATHS[step % len(PATHS)][rank]), y).backward()
        average_used_gradients(net.parameters(), group, bucket_elements=50)  # several buckets
        opt.step()
    return {k: v.clone() for k, v in net.state_dict().items()}


def reference(world: int, steps: int) -> nn.Module:
    """One process: per step, each model's gradients alone, then every weight's gradient
    averaged over the models that used it; the optimizer skips the weights none used."""
    net, data = make_net(), batches(steps * world)
    opt = make_opt(net)
    net.train()
    params = list(net.parameters())
    for step in range(steps):
        per_model = []
        for r in range(world):
            net.zero_grad(set_to_none=True)
            x, y = data[step * world + r]
            F.cross_entropy(net(x, PATHS[step % len(PATHS)][r]), y).backward()
            per_model.append([None if p.grad is None else p.grad.clone() for p in params])
        for i, p in enumerate(params):
            used = [g[i] for g in per_model if g[i] is not None]
            p.grad = torch.stack(used).mean(0) if used else None
        opt.step()
    return net


def assert_close(got: dict, want: dict, what: str) -> None:
    for name, w in want.items():
        g = got[name].double()
        w = w.double()
        err = ((g - w).abs().max() / w.abs().max().clamp_min(1e-12)).item()
        assert err <= TOL, f"{what}: {name} differs by {err:.1e} of its largest magnitude"


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_equal_one_process_averaging_over_users(world):
    steps = 4
    states = spawn(_train_rank, world, steps, timeout=120)
    want = reference(world, steps)
    params = dict(want.named_parameters())
    for rank, state in enumerate(states):
        assert_close({k: state[k] for k in params}, {k: p.detach() for k, p in params.items()},
                     f"rank {rank} of {world}")
    # The unused candidate of step 0 and the once-used ones really moved or stayed as they
    # should: a weight nobody ever used keeps its initial value on every rank.
    init = make_net().state_dict()
    used = {(i, c) for step in PATHS[:steps] for path in step[:world] for i, c in enumerate(path)}
    for i in range(2):
        for c in range(3):
            name = f"layers.{i}.{c}.0.weight"
            moved = not torch.equal(states[0][name], init[name])
            assert moved == ((i, c) in used), name
    # BatchNorm running statistics stay per rank (no SyncBN): rank 0's and rank 1's differ.
    assert not torch.equal(states[0]["layers.0.0.1.running_mean"],
                           states[1]["layers.0.0.1.running_mean"])


def _hand_rank(rank: int, world: int, group, on_gpu: bool = False) -> list:
    """Four parameters whose gradients are set by hand (one float64):
    a: used by every rank (grads 1, 2, 3) -> 2; b: used by rank 1 only (grad 5) -> 5, not 5/3;
    c: used by none -> None; d: used by ranks 0 and 2 (grads 1 and 4) -> 2.5."""
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else None
    a, b, c = (nn.Parameter(torch.zeros(2, 3, device=device)) for _ in range(3))
    d = nn.Parameter(torch.zeros(4, dtype=torch.float64, device=device))
    a.grad = torch.full((2, 3), float(rank + 1), device=device)
    if rank == 1:
        b.grad = torch.full((2, 3), 5.0, device=device)
    if rank != 1:
        d.grad = torch.full((4,), 1.0 if rank == 0 else 4.0, dtype=torch.float64, device=device)
    counts = average_used_gradients([a, b, c, d], group, bucket_elements=4)
    assert all(p.grad is None or p.grad.device == p.device for p in (a, b, c, d))
    return [counts.tolist()] + [None if p.grad is None else p.grad.cpu() for p in (a, b, c, d)]


def check_hand_computed(results: list) -> None:
    for rank, (counts, a, b, c, d) in enumerate(results):
        assert counts == [3, 1, 0, 2], rank
        assert torch.equal(a, torch.full((2, 3), 2.0)), rank
        assert torch.equal(b, torch.full((2, 3), 5.0)), rank  # the single user's, unscaled
        assert c is None, rank  # no rank used it: the optimizer skips it everywhere
        assert d.dtype == torch.float64 and torch.equal(d, torch.full((4,), 2.5, dtype=d.dtype))


def test_hand_computed_counts_and_unscaled_single_user():
    check_hand_computed(spawn(_hand_rank, 3, timeout=60))


@pytest.mark.gpu
def test_hand_computed_on_a_shared_gpu_through_gloo():
    """Three ranks on the GPU(s) there are (sharing them), gradients on CUDA, gloo between."""
    check_hand_computed(spawn(_hand_rank, 3, True, timeout=120))


@pytest.mark.gpu
def test_hand_computed_on_nccl():
    if torch.cuda.device_count() < 3:  # the hand-worked case has three ranks
        pytest.skip("NCCL needs a GPU per rank: the hand-worked case needs 3 GPUs")
    check_hand_computed(spawn(_hand_rank, 3, True, backend="nccl", timeout=120))


def _mismatched_rank(rank: int, world: int, group) -> None:
    params = [nn.Parameter(torch.zeros(3)) for _ in range(2 + rank)]  # rank 1 has one more
    for p in params:
        p.grad = torch.ones(3)
    average_used_gradients(params, group)


def test_different_parameters_on_the_ranks_are_named():
    with pytest.raises(RankError, match=r"rank 0: 2 parameters, 6 elements, rank 1: 3 "
                                        r"parameters, 9 elements"):
        spawn(_mismatched_rank, 2, timeout=60)


def test_average_used_gradients_outside_a_group_says_how_to_run_it():
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="retiarii.optim.spawn"):
        average_used_gradients([p])


def _fail_on_rank_1(rank: int, world: int, group, folder: str) -> int:
    with open(os.path.join(folder, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        raise ValueError("rank one is broken on purpose")
    torch.distributed.barrier(group)  # waits for rank 1 forever: spawn must stop it
    return rank


def _exit_on_rank_2(rank: int, world: int, group) -> int:
    if rank == 2:
        os._exit(3)
    torch.distributed.barrier(group)
    return rank


def _gone(pid: int) -> bool:
    """The process exited (a zombie that nobody reaped yet counts: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_spawn_names_the_failing_rank_and_leaves_no_process(tmp_path):
    with pytest.raises(RankError, match="rank 1 of 3 failed") as info:
        spawn(_fail_on_rank_1, 3, str(tmp_path), timeout=60)
    assert info.value.rank == 1
    assert "ValueError: rank one is broken on purpose" in info.value.traceback
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(3)]
    assert all(_gone(pid) for pid in pids), pids


def test_spawn_reports_a_rank_that_dies_without_a_word():
    with pytest.raises(RankError, match=r"rank 2 of 3 failed:\nthe process exited with code 3"):
        spawn(_exit_on_rank_2, 3, timeout=60)


def _sleep_on_rank_0(rank: int, world: int, group, folder: str) -> int:
    with open(os.path.join(folder, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 0:
        time.sleep(120)
    return rank


def test_spawn_stops_every_rank_at_its_timeout(tmp_path):
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 2 did not finish within 3 s"):
        spawn(_sleep_on_rank_0, 2, str(tmp_path), timeout=3)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    assert all(_gone(pid) for pid in pids), pids


KILLED_PARENT = """
import sys
sys.path[:0] = {path!r}
from retiarii.engine.executors.local_ranks import spawn
from test_mixed_parallel import _sleep_on_rank_0
spawn(_sleep_on_rank_0, 2, {folder!r})
"""


@pytest.mark.slow  # a fresh interpreter starts torch, a forkserver and two ranks: 10-40 s
def test_ranks_exit_when_the_parent_is_killed(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    script = KILLED_PARENT.format(path=[here, os.path.dirname(here)], folder=str(tmp_path))
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        files = [tmp_path / f"pid{r}" for r in range(2)]
        deadline = time.monotonic() + 180
        while not all(f.exists() and f.read_text() for f in files):
            assert parent.poll() is None and time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.1)
    finally:
        parent.kill()
        parent.wait()
    pids = [int(f.read_text()) for f in files]
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in pids), pids


def _ranks(rank: int, world: int, group) -> tuple[int, int, int]:
    t = torch.tensor([rank + 1])
    torch.distributed.all_reduce(t, group=group)
    return rank, world, int(t)


def test_spawn_returns_results_in_rank_order_and_rejects_bad_input():
    assert spawn(_ranks, 3, timeout=60) == [(0, 3, 6), (1, 3, 6), (2, 3, 6)]
    with pytest.raises(ValueError, match="world >= 1"):
        spawn(_ranks, 0)
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        spawn(_ranks, 2, backend="mpi")
    with pytest.raises(ValueError, match="nccl.*GPU per rank"):
        spawn(_ranks, 2, backend="nccl")  # the tests hide the GPUs (conftest)


# ---- a segment of a one-shot strategy --------------------------------------------------------


class ToySPOS(OneShot):
    """A minimal single-path strategy on TinySuper: per batch it draws ``world`` paths from its
    own generator (the same on every rank) and trains the one of its rank; then it evaluates
    its last path on the validation batches."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def setup(self, space, trainer, hparams, device):
        self.net = make_net()
        self.opt = make_opt(self.net)
        self.gen = torch.Generator().manual_seed(self.seed)

    def num_segments(self) -> int:
        return 2

    def sample(self, world: int) -> list[tuple[int, int]]:
        return [tuple(torch.randint(0, 3, (2,), generator=self.gen).tolist())
                for _ in range(world)]

    def run_segment(self, ctx: SegmentContext) -> SegmentResult:
        self.net.train()
        for x, y in ctx.train_batches():
            path = self.sample(ctx.world)[ctx.rank]
            self.opt.zero_grad(set_to_none=True)
            F.cross_entropy(self.net(x, path), y).backward()
            if ctx.world > 1:
                average_used_gradients(self.net.parameters(), ctx.group)
            self.opt.step()
        self.net.eval()
        with torch.no_grad():
            acc = sum((self.net(x, path).argmax(1) == y).float().mean().item()
                      for x, y in ctx.valid_batches()) / len(ctx.valid_batches())
        return SegmentResult({"segment": ctx.segment}, [EvaluatedModel({"path": list(path)},
                                                                       {"val_acc": acc})])

    def state_dict(self) -> dict:
        return {"net": self.net.state_dict(), "opt": self.opt.state_dict(),
                "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.net.load_state_dict(state["net"])
        self.opt.load_state_dict(state["opt"])
        self.gen.set_state(state["gen"])

    def selected(self) -> dict:
        return {}


def build_toy(segment: int):
    s = ToySPOS()
    s.setup(None, None, {}, torch.device("cpu"))
    return s, SegmentContext(segment, None, {}, torch.device("cpu"), train=batches(7),
                             valid=batches(2, seed=9))


def toy_reference(world: int, segments: int) -> nn.Module:
    s, _ = build_toy(0)
    params = list(s.net.parameters())
    data = batches(7)[:7 // world * world]  # the last 7 % K batches are left out
    for _ in range(segments):
        for step in range(len(data) // world):
            paths = s.sample(world)
            per_model = []
            for r in range(world):
                s.net.zero_grad(set_to_none=True)
                x, y = data[step * world + r]
                F.cross_entropy(s.net(x, paths[r]), y).backward()
                per_model.append([None if p.grad is None else p.grad.clone() for p in params])
            for i, p in enumerate(params):
                used = [g[i] for g in per_model if g[i] is not None]
                p.grad = torch.stack(used).mean(0) if used else None
            s.opt.step()
    return s.net


def test_run_segment_on_ranks_resumes_and_equals_one_process():
    world = 2
    first, state = run_segment_on_ranks(functools.partial(build_toy, 0), None, world, timeout=120)
    assert first.metrics == {"segment": 0}
    assert len(first.models) == world  # rank 0's model, then rank 1's
    second, state = run_segment_on_ranks(functools.partial(build_toy, 1), state, world,
                                         timeout=120)
    assert second.metrics == {"segment": 1}
    want = toy_reference(world, 2)
    assert_close({k: state["net"][k] for k, _ in want.named_parameters()},
                 {k: p.detach() for k, p in want.named_parameters()}, "two segments on 2 ranks")
    # The models are each rank's last path, in rank order.
    s, _ = build_toy(0)
    draws = [s.sample(world) for _ in range(2 * (7 // world))]
    assert [m.sample["path"] for m in first.models] == [list(p) for p in draws[2]]
    assert [m.sample["path"] for m in second.models] == [list(p) for p in draws[5]]


@pytest.mark.parametrize("world, shares", [
    (2, [[0, 2, 4], [1, 3, 5]]),  # batch 6 of 7 left out: rank 0 would wait for rank 1
    (3, [[0, 3], [1, 4], [2, 5]]),
    (1, [[0, 1, 2, 3, 4, 5, 6]]),
])
def test_each_rank_takes_every_kth_batch_and_as_many_as_the_others(world, shares):
    for rank, want in enumerate(shares):
        for data in (list(range(7)), iter(range(7))):  # a sized loader, a one-pass generator
            share = _Share(data, rank, world)
            assert len(share) == len(want) and list(share) == want and list(share) == want


def test_buckets_hold_consecutive_parameters_up_to_the_limit():
    assert size_buckets([0, 1, 2, 3, 4], [3, 3, 10, 1, 1], 6) == [[0, 1], [2], [3, 4]]
    assert size_buckets([5, 6], [6, 6], 4) == [[5], [6]]  # larger than a bucket: alone
    assert size_buckets([], [], 4) == []
