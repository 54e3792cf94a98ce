"""Runs or resumes a FunctionTrainer search in its own process (to be SIGKILLed mid-trial).

usage: python func_driver.py STORE run|resume
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import retiarii as rt  # noqa: E402
from engine_helpers import InProcessExecutor  # noqa: E402
from func_space import func_trainer, space  # noqa: E402

if __name__ == "__main__":
    store, mode = sys.argv[1], sys.argv[2]
    # in-process jobs: a SIGKILL of the driver lands inside the user's function
    exp = rt.Experiment(space, rt.strategies.Random(seed=0), func_trainer, store=store,
                        executor=InProcessExecutor(), max_models=4, seed=0, metric="val_acc",
                        scheduler=rt.strategies.ASHA(metric="val_acc", mode="max",
                                                    grace_period=1, max_t=4, reduction_factor=2))
    exp.run() if mode == "run" else exp.resume()
