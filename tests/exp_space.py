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
