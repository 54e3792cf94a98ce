"""Function trainers for the tests, importable by worker processes (`func_space:...`).

One training written twice: as a `Trainer` subclass (`ref_trainer`) and as a plain function
(`train`, wrapped in `func_trainer`), so that the engine's results for both can be compared
bit for bit. The model has dropout, so the RNG streams matter.
"""
import os
import signal

import torch
from torch import nn

import retiarii as rt
from retiarii.engine.trainers.trainer import Trainer

# Synthetic 4-class data, made once per process from a fixed generator.
_g = torch.Generator().manual_seed(1234)
X = torch.randn(384, 16, generator=_g)
Y = (X[:, :4].argmax(dim=1) + (X[:, 4] > 1.0).long()) % 4
XV, YV = X[:96], Y[:96]
XT, YT = X[96:], Y[96:]
BATCH = 48


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        hidden = rt.ValueChoice([16, 32], label="hidden")
        self.fc1 = rt.nn.Linear(16, hidden)
        self.act = rt.LayerChoice({"relu": nn.ReLU(), "tanh": nn.Tanh()}, label="act")
        self.drop = nn.Dropout(0.3)
        self.fc2 = rt.nn.Linear(hidden, 4)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


space = rt.ModelSpace(Net(), example_input=torch.zeros(2, 16))
LRS = [0.02, 0.05, 0.1]


def batches(epoch):
    order = torch.randperm(len(XT), generator=torch.Generator().manual_seed(epoch))
    return [(XT[i], YT[i]) for i in order.split(BATCH)]


class RefTrainer(Trainer):
    """The reference: the same training through the engine's hooks."""

    epochs = 4

    def __init__(self):
        self.lr = rt.ValueChoice(LRS, label="lr")

    def configure_optimizers(self, model, hparams):
        return torch.optim.SGD(model.parameters(), lr=hparams["lr"], momentum=0.9)

    def train_dataloader(self, hparams, epoch):
        return batches(epoch)

    def val_dataloader(self, hparams):
        return [(XV, YV)]

    def training_step(self, model, batch, hparams):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def validation_step(self, model, batch):
        x, y = batch
        logits = model(x)
        return {"val_loss": nn.functional.cross_entropy(logits, y),
                "val_acc": (logits.argmax(1) == y).float().mean()}


ref_trainer = RefTrainer()


@torch.no_grad()
def validate(model):
    model.eval()
    logits = model(XV)
    n = len(YV)
    # as the engine averages a validation_step: float(value) * n / n
    return {"val_loss": float(nn.functional.cross_entropy(logits, YV)) * n / n,
            "val_acc": float((logits.argmax(1) == YV).float().mean()) * n / n}


def train(model, hparams, session):
    """The same training as RefTrainer, as a user's own loop with three calls added."""
    opt = torch.optim.SGD(model.parameters(), lr=hparams["lr"], momentum=0.9)
    state, start = session.load(), 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        for group in opt.param_groups:  # a PBT child's new learning rate
            group["lr"] = hparams["lr"]
        start = state["epoch"]
    for epoch in range(start, hparams["epochs"]):
        model.train()
        total, count = torch.zeros(()), 0
        for x, y in batches(epoch):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach().reshape(()) * len(y)
            count += len(y)
        metrics = {"train_loss": float(total) / count, **validate(model)}
        crash = hparams.get("crash_at")  # tests: lose the worker once, at this epoch
        if crash and epoch + 1 == crash and not os.path.exists(hparams["crash_marker"]):
            open(hparams["crash_marker"], "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        session.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1})
        session.report(epoch + 1, **metrics)


func_trainer = rt.FunctionTrainer(train, epochs=4, lr=rt.ValueChoice(LRS, label="lr"))


def tune(model, hparams, session):
    """Model-free: a quadratic in (x, y) with noise from the trial's torch stream."""
    assert model is None
    state = session.load()
    value, start = (0.0, 0) if state is None else (state["value"], state["step"])
    for step in range(start, hparams["epochs"]):
        value += -(hparams["x"] - 0.3) ** 2 - (hparams["y"] - 2) ** 2 \
            + 0.01 * float(torch.rand(()))
        session.save({"value": value, "step": step + 1})
        session.report(step + 1, score=value / (step + 1))


tuner = rt.FunctionTrainer(tune, epochs=3, x=rt.ValueChoice([0.0, 0.3, 0.6], label="x"),
                           y=rt.ValueChoice([1, 2, 3], label="y"))
