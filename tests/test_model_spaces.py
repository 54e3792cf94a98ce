"""The NAS spaces of model_spaces/ and the `retiarii nas` launcher.

Every implemented row's small preset: its size where finite, random samples that build and
pass the shape check, one training step on digits, and the export round trip of one sample
(``graph.to_source`` executed in a fresh namespace computes the same outputs with the same
weights). Every paper preset is built and shape-checked on a small input. The launcher's list
is checked against the table in docs/spaces.md.
"""
from __future__ import annotations

import functools
import math
import random
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import retiarii as rt
from retiarii import nas
from retiarii.cli import main
from retiarii.engine.trainers.trainer import load_dataset

ROOT = Path(__file__).resolve().parents[1]
IMPLEMENTED = [row.name for row in nas.implemented()]
SIZES = {  # the sizes the module docstrings state (None: counted by a formula tested below)
    "nasbench201": 15_625,
    "darts": 8 ** 28,  # an op or none per edge; DARTS derives 1_037_664_180 ** 2 of them
    "nasnet": 71_465_842_174_521_600 ** 2,
    "amoebanet": 71_465_842_174_521_600 ** 2,
    "nasbench101": 169_093_980,
    "mnasnet": 24 ** 7,
    # the mobile-network family (tests/test_model_spaces_mobile.py checks the formulas)
    "spos": 4 ** 20,
    "efficientnet": 8 * 24 ** 5 * 16 * 27,
    "fbnet": 9 ** 22,
    "proxylessnas": 6 ** 6 * 7 ** 15,
    "fairnas": 6 ** 19,
    "scarlet_nas": 6 ** 6 * 7 ** 13,
    "single_path_nas": 4 ** 6 * 5 ** 15,
    "once_for_all": 7371 ** 2,
    "chamnet": 4_649_045_868,
    "enas_cnn": 5_062_500_000_000 ** 2,
    "wann": math.inf,
    "path_level": math.inf,
    "large_scale_evolution": math.inf,
    "pnas": 556_869_504_614_656,
    "enas_rnn": 4 ** 12 * math.factorial(11),
    "genetic_cnn": 2 ** 19,
    "oneshot": 1_659_571_200,
    "darts_rnn": 4 ** 8 * math.factorial(8),
    "hierarchical": 7 ** 46,
    "textnas": 262_144,
    "neural_predictor": 169_093_980,
}


@functools.lru_cache(maxsize=None)
def small(name: str) -> rt.ModelSpace:
    return nas.build_space(name, "small")


def digits_batch(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_dataset("digits")
    return x[:n], y[:n]


def test_the_rows_are_the_papers_27():
    assert [row.number for row in nas.ROWS] == list(range(1, 28))
    assert len({row.name for row in nas.ROWS}) == 27
    assert {"nasbench201", "nasbench101", "darts"} <= set(IMPLEMENTED)


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_size(name):
    assert name in SIZES, f"state the size of {name} here and in its docstring"
    assert small(name).size() == SIZES[name]


def test_nasbench201_has_exactly_15625_models_all_distinct_cells():
    from model_spaces.nasbench201 import PUBLISHED_SIZE, arch_string

    space = small("nasbench201")
    assert space.size() == PUBLISHED_SIZE == 5 ** 6
    # the 6 edge labels are the only choices: every cell of the network shares them
    sample = space.random_sample(seed=1).sample
    assert sorted(sample) == sorted(f"edge_{i}{j}" for j in range(1, 4) for i in range(j))
    assert arch_string(sample).count("~") == 6


def test_nasbench101_count_matches_the_walk_on_a_smaller_cell():
    from model_spaces import nasbench101 as nb

    # 4 vertices, at most 3 of the 6 edges: the generic exact walk of the space counts what
    # the formula does (the full 7-vertex space is too large to walk in a test)
    reduced = nb.nasbench101_space(4, 1, num_vertices=4, max_edges=3, in_channels=1,
                                   image_size=8)
    assert rt.ModelSpace.size(reduced, exact=True) == nb.count(4, 3) == 9 * 42
    assert nb.count() == 3 ** 5 * sum(math.comb(21, k) for k in range(10)) == 169_093_980


def test_nasbench101_prunes_to_the_input_output_paths():
    from model_spaces import nasbench101 as nb

    assert nb.prune(7, {(0, 1), (1, 6), (2, 3)}) == ({0, 1, 6}, {(0, 1), (1, 6)})
    assert nb.prune(7, {(0, 1), (2, 6)}) == ({0, 6}, {(0, 6)})  # no path: input -> output
    space = small("nasbench101")
    ops = {f"op{v}": "maxpool3x3" for v in range(1, 6)}
    edges = {"edge01": 1, "edge02": 0, "edge12": 1, "edge03": 0, "edge13": 0, "edge23": 1}
    rest = {f"edge{i}{j}": 0 for j in range(4, 7) for i in range(j)}
    rest["edge36"] = 1
    model = space.instantiate({**ops, **edges, **rest})
    names = {n.name.split(".", 2)[-1] for n in model.graph.nodes if n.name.startswith("cells.0.")}
    # vertices 4, 5 are off every path; only vertex 1 reads the (projected) input
    assert {"op1", "op2", "op3", "proj1"} <= names
    assert not names & {"op4", "op5", "proj2", "proj3", "proj4", "proj5", "proj_out"}


def test_darts_reduction_cells_halve_where_they_read_the_cell_inputs():
    from model_spaces import darts

    space = small("darts")
    sample = darts.genotype_sample(random.Random(3))
    sample.update({"reduce/n0/e0": "skip_connect", "reduce/n0/e1": "max_pool_3x3",
                   "reduce/n1/e0": "none", "reduce/n1/e1": "skip_connect",
                   "reduce/n1/e2": "skip_connect"})
    model = space.instantiate(sample)
    ops = {n.name: n.op.spec["cls"] for n in model.graph.nodes if n.name.startswith("cells.1.e")
           and n.op.kind == "module" and n.op.spec}
    assert "FactorizedReduce" in ops["cells.1.e0_0"]  # skip on s0 in a reduction: stride 2
    assert "FactorizedReduce" in ops["cells.1.e1_1"]  # on s1
    assert "Identity" in ops["cells.1.e1_2"]  # on node 0, already halved
    assert "Zero" in ops["cells.1.e1_0"]
    assert model.to_module()(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_random_samples_build_and_pass_the_shape_check(name):
    space = small(name)
    for seed in range(3):
        model = space.instantiate(space.random_sample(seed=seed).sample)
        model.graph.lint()
        out = model.to_module()(torch.zeros(2, 1, 8, 8))
        assert out.shape == (2, 10)
        # (instantiate again, not replay: lazy layers settle their sizes in the shape check)
        again = space.instantiate(model.sample)
        assert again.structural_hash() == model.structural_hash()


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_one_training_step_on_digits(name):
    torch.manual_seed(0)
    space = small(name)
    net = space.build(space.random_sample(seed=7).sample)
    x, y = digits_batch()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in net.parameters()]
    loss = F.cross_entropy(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(b, p) for b, p in zip(before, net.parameters()))


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_export_round_trip(name):
    space = small(name)
    model = space.instantiate(space.random_sample(seed=11).sample)
    torch.manual_seed(0)
    net = model.to_module().eval()
    namespace: dict = {"__name__": f"exported_{name}"}
    exec(compile(model.graph.to_source("Exported"), f"<{name}>", "exec"), namespace)
    exported = namespace["Exported"]().eval()
    # NOTE: compared as sets: for a LayerChoice candidate spliced into a Repeat block
    # (mnasnet's SE), to_source registers the candidate's submodules before the layers after
    # it while to_module registers them in graph order (reported to the IR owners); the
    # weights load by name either way.
    assert sorted(exported.state_dict()) == sorted(net.state_dict())
    exported.load_state_dict(net.state_dict())
    x, _ = digits_batch(8)
    with torch.no_grad():
        assert torch.equal(exported(x), net(x))


@pytest.mark.parametrize("module,preset", sorted({(row.module, fn) for row in nas.implemented()
                                                  for p, fn, _ in row.presets if p == "paper"}))
def test_paper_preset_builds_and_passes_the_shape_check(module, preset):
    # (a module may hold several spaces: model_spaces.recurrent has ENAS's and DARTS')
    row = next(r for r in nas.implemented() if r.module == module and
               ("paper", preset) in {(p, fn) for p, fn, _ in r.presets})
    space = nas.build_space(row.name, "paper", in_channels=3, image_size=8)
    model = space.instantiate(space.random_sample(seed=0).sample)
    # eval: at 8x8 the paper networks reach 1x1 maps, where training-mode BN needs a batch > 1
    assert model.to_module().eval()(torch.zeros(1, 3, 8, 8)).shape == (1, 10)
    if space.open_ended:  # an evolving space's size is its growth, not its preset
        return
    # the paper preset is the big one (MnasNet: ~3.3M against ~0.3M parameters)
    params = sum(p.numel() for p in model.to_module().parameters())
    small_params = sum(p.numel() for p in small(row.name).build(
        small(row.name).random_sample(seed=0).sample).parameters())
    assert params > 5 * small_params


# ---- the launcher ------------------------------------------------------------------------------


def docs_table() -> list[list[str]]:
    text = (ROOT / "docs" / "spaces.md").read_text()
    section = text.split("## The NAS solutions of the literature", 1)[1]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    return [[c.strip() for c in line.strip("|").split("|")] for line in rows]


def test_the_list_matches_the_table_in_the_docs():
    assert docs_table() == nas.table()


def test_nas_list_prints_every_row_with_its_status(capsys):
    assert main(["nas", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    for row in nas.ROWS:
        line = next(line for line in out if re.match(rf"{row.number}\s+{row.name}\s", line))
        assert line.rstrip().endswith(row.status) and row.paper in line


def test_nas_run_of_a_row_not_implemented_says_so(capsys, monkeypatch):
    import dataclasses

    # a row without its space (once every row is written, one made so for the test)
    missing = next((row for row in nas.ROWS if row.status == "not yet"), None)
    if missing is None:
        missing = dataclasses.replace(nas.ROWS[0], module=None)
        monkeypatch.setitem(nas._BY_NAME, missing.name, missing)
    assert main(["nas", "run", missing.name]) == 2
    err = capsys.readouterr().err
    assert "not implemented yet" in err and missing.title in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(["nas", "run", "no_such_row"]) == 2
    assert "nasbench201" in capsys.readouterr().err


def test_a_row_runs_through_the_experiment(tmp_path):
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from engine_helpers import InProcessExecutor

    exp = nas.experiment("nasbench201", max_models=2, epochs=1, store=str(tmp_path / "x.db"),
                         executor=InProcessExecutor())
    summary = exp.run()
    assert summary["trials"].get("TERMINATED") == 2
    assert summary["best"] and 0.0 <= summary["best"][0]["value"] <= 1.0
