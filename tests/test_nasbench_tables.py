"""Published NAS tables (issue #31 item 4): read from files in the published formats written
by tests/nasbench_fixtures.py, never by running what a file names; looked up by our spaces'
samples; replayed by strategies on the simulated clock, through the engine too."""
from __future__ import annotations

import itertools
import os
import pickle
import random
import struct
import subprocess
import sys

import pytest
import torch

import nasbench_fixtures as F
from retiarii import nasbench_tables as T
from retiarii import tabular_bench as B
from retiarii.published_formats import (
    CorruptRecordError, UnsafePickleError, crc32c, decode_protobuf, load_torch_pickle,
    masked_crc32c, read_tfrecords, tfrecord,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", params=[False, True], ids=["legacy", "zip"])
def nb201(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("nb201") / "NAS-Bench-201-v1_0-e61699.pth"
    return T.load("nasbench201", F.write_nb201(str(path), zip_layout=request.param))


@pytest.fixture(scope="module")
def nb101(tmp_path_factory):
    path = tmp_path_factory.mktemp("nb101") / "nasbench_only108.tfrecord"
    return T.load("nasbench101", F.write_nb101(str(path)))


# ---- NAS-Bench-201: the paper's rows ---------------------------------------------------------


def test_the_optimum_of_each_data_set_is_the_papers(nb201):
    """Dong & Yang (ICLR 2020), Table 5, 'optimal': the mean over runs the table holds."""
    published = {"cifar10 test": 94.37, "cifar10 valid": 91.61, "cifar100 test": 73.51,
                 "cifar100 valid": 73.49, "ImageNet16-120 test": 47.31,
                 "ImageNet16-120 valid": 46.77}
    for column, value in published.items():
        assert nb201.optimum(column)[1] == pytest.approx(value, abs=1e-9), column
    assert nb201.optimum("cifar10 test")[0] == F.C10_BEST


def test_our_spaces_sample_finds_the_resnet_row(nb201):
    """The sample of model_spaces/nasbench201.py that builds the ResNet cell is looked up to
    the paper's ResNet row (93.97 / 70.86 / 43.63 test)."""
    from model_spaces.nasbench201 import arch_string, small

    sample = {"edge_01": "nor_conv_3x3", "edge_02": "none", "edge_12": "nor_conv_3x3",
              "edge_03": "skip_connect", "edge_13": "none", "edge_23": "none"}
    assert T.nb201_key(sample) == arch_string(sample) == F.RESNET
    small().instantiate(sample)  # a sample of our space indeed
    reported = nb201.entry(sample).reported
    assert reported["cifar10 test"] == pytest.approx(93.97)
    assert reported["cifar100 test"] == pytest.approx(70.86)
    assert reported["ImageNet16-120 test"] == pytest.approx(43.63)
    run, = nb201.entry(sample).runs  # the 12-epoch run the search is told
    assert run.accuracy[-1] == 78.0 and len(run.accuracy) == nb201.steps == 12
    # numpy float64 training times decoded from their bytes; the evaluation charged once
    assert run.seconds == (12.0,) * 11 + (14.0,)


def test_a_sample_the_table_lacks_is_refused_by_name(nb201):
    sample = dict.fromkeys(T.NB201_EDGES, "avg_pool_3x3")
    with pytest.raises(T.TableError, match="avg_pool_3x3~0"):
        nb201.entry(sample)
    with pytest.raises(T.TableError, match="lacks"):
        T.nb201_key({"edge_01": "none"})


def test_a_file_of_another_structure_is_refused(tmp_path):
    path = str(tmp_path / "x.pth")
    torch.save({"weights": [1.0]}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(T.TableError, match="not a NAS-Bench-201 table.*meta_archs"):
        T.load("nasbench201", path)
    with open(path, "wb") as f:
        pickle.dump({"meta_archs": []}, f)
    with pytest.raises(ValueError, match="not a torch file"):
        T.load("nasbench201", path)


# ---- the restricted unpickler ----------------------------------------------------------------


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("zip_layout", [False, True], ids=["legacy", "zip"])
def test_a_pickle_naming_os_system_is_refused_and_nothing_runs(tmp_path, zip_layout):
    marker = tmp_path / "ran"
    path = str(tmp_path / "evil.pth")
    torch.save({"meta_archs": [_Payload(str(marker))]}, path,
               _use_new_zipfile_serialization=zip_layout)
    with pytest.raises(UnsafePickleError, match=r"names (posix|os|nt)\.system.*refused unread"):
        load_torch_pickle(path)
    with pytest.raises(UnsafePickleError):
        T.load("nasbench201", path)
    assert not marker.exists()


def test_tensors_are_kept_as_references_not_read(tmp_path):
    path = str(tmp_path / "t.pth")
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "x": 1.5}, path)
    loaded = load_torch_pickle(path)
    assert loaded["x"] == 1.5 and loaded["w"].size == (2, 3) and loaded["w"].stride == (3, 1)


# ---- NAS-Bench-101 ---------------------------------------------------------------------------


def _published_sample(order=(1, 2, 3, 4, 5)):
    """The published row's cell as a sample of model_spaces/nasbench101.py; ``order`` places
    its vertices 1..5 at our vertices (any order that keeps the edges forward)."""
    n = 7
    adj = F.PUBLISHED_ADJ
    edges = {(i, j) for i in range(n) for j in range(n) if adj[i * n + j] == "1"}
    place = {0: 0, 6: 6, **{v: order[v - 1] for v in range(1, 6)}}
    sample = {f"op{place[v]}": F.PUBLISHED_OPS[v] for v in range(1, 6)}
    chosen = {(place[i], place[j]) for i, j in edges}
    for j in range(1, n):
        for i in range(j):
            sample[f"edge{i}{j}"] = int((i, j) in chosen)
    return sample


def test_the_module_hash_is_the_published_one():
    """Our hash of the published row's cell is the one the published file keys it by."""
    assert F.nb101_cell_hash(F.PUBLISHED_ADJ, F.PUBLISHED_OPS) == F.PUBLISHED_HASH
    assert T.nb101_key(_published_sample()) == F.PUBLISHED_HASH


def test_the_published_row_is_found_from_our_spaces_sample(nb101):
    from model_spaces.nasbench101 import small

    sample = _published_sample()
    small().instantiate(sample)  # a sample of our space
    entry = nb101.entry(sample)
    assert entry.reported["cifar10 test"] == pytest.approx(92.06063151359558)
    assert entry.reported["cifar10 valid"] == pytest.approx(92.64155824979146)
    assert len(entry.runs) == 3  # the 4-epoch record is not the 108-epoch budget's
    published = next(r for r in entry.runs if r.accuracy[-1] == pytest.approx(92.41786599159241))
    assert sum(published.seconds) == pytest.approx(1769.1279296875)


def test_isomorphic_cells_and_pruned_vertices_map_to_one_row(nb101):
    """Vertices renumbered (the published vertex 4 placed first, 1..3 after it: every edge
    still forward), or the input -> output path cut: the same cell, the same row; no cell."""
    swapped = _published_sample(order=(2, 3, 4, 1, 5))
    assert swapped != _published_sample()
    assert T.nb101_key(swapped) == F.PUBLISHED_HASH
    chain = {**{f"op{v}": "conv3x3-bn-relu" for v in range(1, 6)},
             **{f"edge{i}{j}": int(j == i + 1) for j in range(1, 7) for i in range(j)}}
    assert nb101.entry(chain).reported["cifar10 test"] == pytest.approx(79.0)
    no_path = {**chain, "edge01": 0}
    with pytest.raises(T.TableError, match="outside NAS-Bench-101"):
        nb101.entry(no_path)


def test_hash_tells_non_isomorphic_cells_apart():
    chain = [[0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 1], [0] * 5]
    assert T.nb101_hash(chain, [-1, 1, 0, 0, -2]) != T.nb101_hash(chain, [-1, 0, 0, 1, -2])
    diamond = [[0, 1, 1, 0], [0, 0, 0, 1], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert T.nb101_hash(diamond, [-1, 1, 2, -2]) == T.nb101_hash(diamond, [-1, 2, 1, -2])


# ---- TFRecords and protobufs -----------------------------------------------------------------


def test_crc32c_and_the_record_framing():
    assert crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C
    framed = tfrecord(b"hello")
    assert struct.unpack("<Q", framed[:8])[0] == 5
    assert struct.unpack("<I", framed[-4:])[0] == masked_crc32c(b"hello")


def test_a_corrupted_crc_is_refused_with_the_record_named(tmp_path):
    path = F.write_nb101(str(tmp_path / "nb.tfrecord"))
    data = bytearray(open(path, "rb").read())
    assert len(list(read_tfrecords(path))) == 8
    first = struct.unpack("<Q", data[:8])[0]
    second = 12 + first + 4  # the second record's offset
    data[second + 12 + 40] ^= 0x01  # one bit of its data
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(CorruptRecordError, match=rf"record 1 at byte {second}: the CRC .* "
                                                 r"damaged \(download it again\)"):
        T.load("nasbench101", path)
    with open(path, "wb") as f:
        f.write(bytes(data[:second + 20]))  # truncated inside record 1
    with pytest.raises(CorruptRecordError, match="record 1 .*truncated"):
        list(read_tfrecords(path))


def test_protobuf_decoding_of_the_metrics():
    blob = F.model_metrics([(108.0, 1769.1279296875, 1.0, 0.92, 0.91)], 8_555_530)
    fields = decode_protobuf(blob)
    assert fields[2] == [8_555_530]
    sub = decode_protobuf(fields[1][0])
    assert struct.unpack("<d", sub[2][0])[0] == 1769.1279296875
    assert sub[6] == [b"/ckpt/model.ckpt-1"]
    with pytest.raises(ValueError, match="ends"):
        decode_protobuf(blob[:-3])


# ---- replays ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def complete_table():
    """Every NAS-Bench-201 cell in memory (a Table as load() builds it): quality grows with
    convolutions, two runs per cell, seconds per epoch 8-20."""
    rng, entries = random.Random(0), {}
    for ops in itertools.product(T.NB201_OPS, repeat=6):
        key = T.nb201_key(dict(zip(T.NB201_EDGES, ops)))
        q = sum(op.startswith("nor_conv") for op in ops) / 6 + 0.1 * rng.random()
        runs = tuple(T.Run(tuple((60 + 30 * q + d) * (e + 1) / 12 for e in range(12)),
                           tuple([8 + 12 * q] * 12)) for d in (-0.5, 0.5))
        entries[key] = T.Entry(key, runs, {"cifar10 test": 83 + 11 * q})
    return T.Table("nasbench201", "memory", entries, 12, "synthetic")


def test_the_choice_view_asks_what_our_spaces_ask():
    from model_spaces import nasbench101, nasbench201
    from retiarii.sampler import RandomSampler

    class Recorder:
        def __init__(self, seed):
            self.inner, self.asked = RandomSampler(seed), []

        def choose(self, label, candidates, context):
            self.asked.append((label, list(candidates)))
            return self.inner.choose(label, candidates, context)

    for benchmark, space in (("nasbench201", nasbench201.small()),
                             ("nasbench101", nasbench101.small())):
        view = B.ChoiceView(benchmark)
        assert view.size() == space.size()
        for seed in range(5):
            a, b = Recorder(seed), Recorder(seed)
            assert view.sample(a).sample == space.sample(b).sample
            assert a.asked == b.asked


def test_a_replay_is_seeded_and_held_to_its_budget(complete_table):
    one = B.replay(complete_table, "evolution", 3, 5_000)
    assert one == B.replay(complete_table, "evolution", 3, 5_000)
    assert one and one[-1].time <= 5_000
    assert [p.signal for p in one] == sorted(p.signal for p in one)
    assert all(p.reported == complete_table.entries[p.key].reported for p in one)


def test_the_engine_replay_equals_the_fast_replay(complete_table):
    """rt.Experiment on our nasbench201 space with the SimulatedExecutor replaying the
    table's epochs proposes the same cells at the same simulated times (one worker)."""
    fast = B.replay(complete_table, "evolution", 1, 2_000)
    engine = B.engine_replay(complete_table, "evolution", 1, 2_000, max_models=len(fast) + 2)
    assert [p.key for p in engine] == [p.key for p in fast]
    assert [p.time for p in engine] == pytest.approx([p.time for p in fast])


def test_asha_stops_runs_and_keeps_only_finished_ones_as_held(complete_table):
    points = B.engine_replay(complete_table, "random+asha", 0, 3_000, max_models=24)
    plain = B.engine_replay(complete_table, "random", 0, 3_000, max_models=24)
    assert points and len(points) > len(plain)  # stopped runs free the clock for more models


def test_evolution_beats_random_search_over_20_seeds(complete_table):
    def ends(name):
        return [B.value_at(B.replay(complete_table, name, s, 6_000), 6_000, "cifar10 test")
                for s in range(20)]
    assert sum(ends("evolution")) > sum(ends("random"))


def test_the_cli_compares_strategies_and_writes_csv_and_png(tmp_path):
    path = str(tmp_path / "NAS-Bench-201-v1_0-e61699.pth")
    torch.save(F.nb201_complete_data(), path, _use_new_zipfile_serialization=False)
    out = subprocess.run([sys.executable, "-m", "retiarii.cli", "nas", "bench", "nasbench201",
                          "--table", path, "--strategy", "random,evolution", "--seeds", "3",
                          "--time-budget", "3000", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REA: 93.92±0.30" in out.stdout and "RS: 93.70±0.36" in out.stdout
    for name in ("nasbench201_replay.csv", "nasbench201_replay_summary.csv",
                 "nasbench201_replay.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0


test_the_cli_compares_strategies_and_writes_csv_and_png = pytest.mark.slow(
    test_the_cli_compares_strategies_and_writes_csv_and_png)


def test_the_cli_refuses_a_missing_or_unsafe_table(tmp_path):
    run = [sys.executable, "-m", "retiarii.cli", "nas", "bench", "nasbench201", "--table"]
    out = subprocess.run(run + [str(tmp_path / "none.pth")], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "no such file" in out.stderr
    evil = str(tmp_path / "evil.pth")
    torch.save([_Payload(str(tmp_path / "ran"))], evil)
    out = subprocess.run(run + [evil], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "refused unread" in out.stderr
    assert not (tmp_path / "ran").exists()
