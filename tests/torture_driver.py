"""Runs or resumes a crash-torture search in its own process, SIGKILLing itself at a store write.

usage: python torture_driver.py STORE run|resume trials|one-shot SIZE BATCH DIE_AT

``trials``: a Random search of SIZE models of ``torture_space`` on two worker processes,
grouped (``optimize=True``), fused (``fuse=True``) and packed (``packing=True``) in jobs of up
to BATCH trials. ``one-shot``: tests/one_shot_helpers.py's PerArchitecture strategy over SIZE
segments on one worker process. DIE_AT > 0: the driver SIGKILLs itself at that store write
(torture_space.die_at_store_write); 0: it runs to the end. Workers die where
``TORTURE_KILLS`` says (torture_space.KillingTrainer).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import retiarii as rt  # noqa: E402
import torture_space  # noqa: E402
from retiarii.engine import LocalExecutor  # noqa: E402

ONE_SHOT_MODELS = 2  # architectures per one-shot segment


def experiment(store: str, kind: str, size: int, batch: int, executor) -> rt.Experiment:
    """The search a torture run drives (the test builds its reference from the same call)."""
    if kind == "trials":
        return rt.Experiment(torture_space.space, rt.strategies.Random(seed=0),
                             torture_space.trainer, store=store, executor=executor,
                             max_models=size, seed=0, optimize=True, fuse=True, packing=True,
                             batch_models=batch, max_failures=5)
    from one_shot_helpers import PerArchitecture, space

    strategy = PerArchitecture(epochs=size, models_per_segment=ONE_SHOT_MODELS)
    return rt.Experiment(space, strategy, torture_space.one_shot_trainer, store=store, seed=0,
                         executor=executor, max_failures=5)


if __name__ == "__main__":
    torch.set_num_threads(1)
    store, mode, kind = sys.argv[1], sys.argv[2], sys.argv[3]
    size, batch, die_at = (int(a) for a in sys.argv[4:7])
    if die_at:
        torture_space.die_at_store_write(die_at)
    # one thread per worker, as the in-process reference trains: a matmul's rounding depends
    # on the threads that share it
    with LocalExecutor(2 if kind == "trials" else 1, [], threads_per_worker=1) as executor:
        exp = experiment(store, kind, size, batch, executor)
        exp.run() if mode == "run" else exp.resume()
