"""Spaces whose models fail, each in one way, importable by workers (`failing_spaces:NAME`)."""
import torch
from torch import nn

import retiarii as rt


@rt.leaf
class Boom(nn.Module):
    """Fine in eval mode (shape checks pass); raises in training: every trial fails."""

    def forward(self, x):
        if self.training:
            raise ZeroDivisionError("the training step divided by zero")
        return x


class AlwaysFails(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc = rt.nn.Linear(64, rt.ValueChoice([16, 32, 48], label="h"))
        self.boom = Boom()

    def forward(self, x):
        return self.boom(self.fc(self.flatten(x)))[:, :10]


class HalfBuilds(nn.Module):
    """h=32 feeds 32 features to a layer that takes 16: that model cannot be built."""

    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc = rt.nn.Linear(64, rt.ValueChoice([16, 32], label="h"))
        self.out = nn.Linear(16, 10)

    def forward(self, x):
        return self.out(self.fc(self.flatten(x)))


EXAMPLE = torch.zeros(2, 1, 8, 8)
always_fails = rt.ModelSpace(AlwaysFails(), example_input=EXAMPLE)  # 3 models, none trains
half_builds = rt.ModelSpace(HalfBuilds(), example_input=EXAMPLE)  # 2 models, one cannot build
