"""Path-level NAS trains its networks as the paper does (SGD with Nesterov momentum): under
Adam a replicated node's copies step as the node alone, so children tie with the start
network; under the row's SGD they do not, and the start network still learns the digits."""
from __future__ import annotations

import pytest
import torch

from model_spaces import path_level as pl
from retiarii import nas, nas_retrain
from retiarii.engine.trainers.inheritance import inherit_matching
from retiarii.engine.trainers.trainer import ClassifierTrainer
from retiarii.engine.trainers.trial_training import TrialRun
from retiarii.strategies.multi_trial import path_level_rl as plrl

SPACE = nas.build_space("path_level", "small")


def _train(steps, settings, epochs, parent=None, seed=5):
    """(model, last epoch's metrics) of the network of ``steps`` trained ``epochs`` epochs
    with ``settings``, from ``parent``'s weights (through the cells' transfers) if given."""
    def build():
        model = SPACE.build(plrl.to_sample(steps))
        if parent is not None:
            kept, fresh = inherit_matching(model, parent)
            assert not fresh  # every tensor inherited: the child is the parent's function
        return model

    run = TrialRun(build, ClassifierTrainer(dataset="digits", epochs=epochs, **settings),
                   seed=seed)
    metrics = [run.train_epoch() for _ in range(epochs)][-1]
    return run.model, metrics


@pytest.fixture(scope="module")
def parent():
    """The start network after one epoch of the row's recipe: the children's parent."""
    model, _ = _train([], pl.TRAINER, 1, seed=3)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_the_row_searches_and_retrains_with_nesterov_sgd(tmp_path):
    exp = nas.experiment("path_level", max_models=2, store=str(tmp_path / "pl.db"))
    assert exp.trainer.config.optimizer == "nesterov" and exp.trainer.config.lr == 0.1
    opt, sched = exp.trainer.configure_optimizers(torch.nn.Linear(2, 2), {})
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.SGD) and group["nesterov"] and group["momentum"] == 0.9
    assert group["weight_decay"] == 1e-4 and isinstance(
        sched, torch.optim.lr_scheduler.CosineAnnealingLR)
    assert nas_retrain.recipe("path_level").optimizer == "nesterov"
    # another row keeps the launcher's Adam
    other = nas.experiment("nasbench201", max_models=2, store=str(tmp_path / "nb.db"))
    assert other.trainer.config.optimizer == "adam"


@pytest.mark.parametrize("base, child", [
    ([], [["r", "replicate", None]]),  # the start cell vs the same cell replicated
    ([["r", "split", None]], [["r", "split", None], ["r.1", "replicate", None]]),
])
def test_children_differing_by_a_replication_tie_under_adam_but_not_under_the_rows_sgd(
        parent, base, child):
    sgd = [_train(steps, pl.TRAINER, 1, parent)[1] for steps in (base, child)]
    adam = [_train(steps, {}, 1, parent)[1] for steps in (base, child)]  # lr 1e-3
    # Adam: the copies' half gradients give the same steps (up to its eps): a tie
    assert adam[0]["val_acc"] == pytest.approx(adam[1]["val_acc"], abs=1e-6)
    assert adam[0]["val_loss"] == pytest.approx(adam[1]["val_loss"], abs=2e-3)
    # SGD: the copies step half as far, and the trajectories part
    assert abs(sgd[0]["val_loss"] - sgd[1]["val_loss"]) > 0.02
    assert abs(sgd[0]["val_loss"] - sgd[1]["val_loss"]) > \
        10 * abs(adam[0]["val_loss"] - adam[1]["val_loss"])


def test_a_deepening_alone_still_ties_under_sgd(parent):
    """A node inserted with an identity edge adds no weights and changes no step: the same
    training, bit for bit (its use is the edge a later change_op gives an operation)."""
    a = _train([], pl.TRAINER, 1, parent)[1]
    b = _train([["r", "deepen", None]], pl.TRAINER, 1, parent)[1]
    assert a == b


def test_the_start_network_learns_the_digits_with_the_rows_recipe():
    _, metrics = _train([], pl.TRAINER, 2, seed=3)  # the launcher's 2 epochs a network
    assert metrics["val_acc"] >= 0.85  # measured 0.905 (seed 3)
