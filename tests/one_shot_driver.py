"""Runs or resumes the one-shot engine tests' search in its own process (to be SIGKILLed).

usage: python one_shot_driver.py STORE run|resume
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import retiarii as rt  # noqa: E402
from one_shot_helpers import PerArchitecture, space, trainer  # noqa: E402
from retiarii.engine import LocalExecutor  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)
    store, mode = sys.argv[1], sys.argv[2]
    with LocalExecutor(1, [], threads_per_worker=1) as executor:
        # each segment waits 1 s first: the test kills this driver in that window
        strategy = PerArchitecture(epochs=3, models_per_segment=2, sleep_s=1.0)
        exp = rt.Experiment(space, strategy, trainer,
                            store=store, seed=0, executor=executor)
        exp.run() if mode == "run" else exp.resume()
