"""Runs or resumes the engine tests' experiment in its own process (to be SIGKILLed).

usage: python exp_driver.py STORE run|resume MAX_MODELS WORKERS
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import retiarii as rt  # noqa: E402
from exp_space import space, trainer  # noqa: E402


def experiment(store: str, max_models: int, workers: int) -> rt.Experiment:
    # fuse=False: a resumed run is compared with an uninterrupted one bit for bit, and fusion
    # chosen by measured time in one run and not in the other would differ by its rounding
    return rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=store,
                         workers=workers, max_models=max_models, seed=0, max_failures=2,
                         fuse=False)


if __name__ == "__main__":
    torch.set_num_threads(1)
    store, mode, max_models, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    exp = experiment(store, max_models, workers)
    exp.run() if mode == "run" else exp.resume()
