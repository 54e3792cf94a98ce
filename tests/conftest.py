"""Shared test set-up."""
import os

import pytest
import torch

# Tests run two processes at a time on two cores (pytest -n 2); torch's own thread pool on top
# of that oversubscribes the CPU and makes small convolutions hundreds of times slower.
torch.set_num_threads(1)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_configure(config):
    """The default suite is the CPU suite: on a machine with a GPU it still trains on the CPU,
    where its claims are exact (resumed equals uninterrupted bit for bit, grouped equals
    alone); GPU kernels are bit-reproducible only in deterministic mode, so the GPU paths are
    the tests marked ``gpu`` (``pytest -m gpu``), run in that mode, which state their
    tolerances. Hiding the GPUs before CUDA
    starts pins the test processes and the workers they spawn to the CPU."""
    markexpr = config.getoption("markexpr", "") or ""
    if "gpu" not in markexpr.replace("not gpu", ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    else:  # the GPU tests run in deterministic mode, which cuBLAS must know before it starts
        from retiarii.determinism import prepare_worker

        prepare_worker()


@pytest.fixture
def few_digits(monkeypatch):
    """The digits cut to their first 60 images (the NAS rows' end-to-end tests)."""
    from retiarii.engine.trainers import trainer as trainer_module

    x, y = trainer_module.load_dataset("digits")
    monkeypatch.setitem(trainer_module._DATASETS, "digits", (x[:60], y[:60]))


@pytest.fixture
def in_process(monkeypatch):
    """Searches with local workers (``retiarii nas run``'s) train in this process."""
    from engine_helpers import InProcessExecutor

    monkeypatch.setattr("retiarii.engine.executors.local.LocalExecutor.for_search",
                        lambda *args, **kwargs: InProcessExecutor())
