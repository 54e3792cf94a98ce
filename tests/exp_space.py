"""A small space for the engine tests, importable by worker processes (`exp_space:space`)."""
import torch
from torch import nn

import retiarii as rt


@rt.leaf
class NaNInTraining(nn.Module):
    """Passes shape checks (eval mode) but makes every training loss NaN: a model that always
    fails."""

    def forward(self, x):
        return x * float("nan") if self.training else x


class MLP(nn.Module):
    def __init__(self, failing: bool = False):
        super().__init__()
        hidden = rt.ValueChoice([16, 32], label="hidden")
        self.flatten = nn.Flatten()
        self.fc1 = rt.nn.Linear(64, hidden)
        acts = {"relu": nn.ReLU(), "tanh": nn.Tanh()}
        if failing:
            acts["nan"] = NaNInTraining()
        self.act = rt.LayerChoice(acts, label="act")
        self.fc2 = rt.nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.flatten(x))))


EXAMPLE = torch.zeros(2, 1, 8, 8)
space = rt.ModelSpace(MLP(), example_input=EXAMPLE)                 # 4 models (x 3 lrs)
failing_space = rt.ModelSpace(MLP(failing=True), example_input=EXAMPLE)  # 6 models (x 3 lrs)
trainer = rt.Trainer(dataset="digits", epochs=2, batch_size=128,
                     lr=rt.ValueChoice([0.01, 0.03, 0.1], label="lr"))


# One architecture each (no mutator): a search over the trainer's learning rate alone, what
# fusion serves (tests/test_layouts.py).
class FixedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)


class FixedCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                 nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 16, 10))

    def forward(self, x):
        return self.net(x)


mlp_space = rt.ModelSpace(FixedMLP(), example_input=EXAMPLE)
cnn_space = rt.ModelSpace(FixedCNN(), example_input=EXAMPLE)
lr_trainer = rt.Trainer(dataset="digits", epochs=2, batch_size=256,
                        lr=rt.ValueChoice([0.01, 0.02, 0.03, 0.05], label="lr"))
