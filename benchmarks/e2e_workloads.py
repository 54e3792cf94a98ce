"""The spaces and trainers of the whole-search benchmark (``optimize_e2e.py``, issue #26 item 7).

Written the way a user writes them: plain PyTorch modules, retiarii mutators and choices, a
trainer. Five workloads (the issue's (a)-(e)):

- ``a``: heads on a frozen ResNet-18-style trunk (``requires_grad_(False)``, BatchNorms left
  in train mode, since training calls ``.train()``); a mutator chooses one of N heads;
- ``b``: a residual adapter after one of 8 different blocks of a frozen MobileNetV2 (train-mode
  BatchNorm), and the same backbone frozen with ``rt.freeze`` (``bfreeze``);
- ``c``: MLPs in-W-W-10 whose space chooses the activation at two places (16 models);
- ``d``: a MnasNet-like space (kernel, expansion, squeeze-excite per searched stage; 64
  models) trained on JPEG files through a DataLoader (:func:`jpeg_trainer`);
- ``e``: the demo (``retiarii.demo``).

Worker processes rebuild a space or trainer by reference, ``"/abs/.../e2e_workloads.py:NAME"``.
The names are made on first use (a module ``__getattr__``), so a worker builds only the one
its search needs, and the size is in the name, not in the environment::

    SPACE_A4, TRAINER_A        workload (a) at 4 heads, full size
    SPACE_A4_QUICK             the smoke test's size (--quick: half the heads, tiny data)
    SPACE_B, SPACE_BFREEZE, SPACE_C64, SPACE_C512, SPACE_D  (and TRAINER_B, TRAINER_C, ...)

Every frozen value is made under a fixed seed, so each process builds the same ones.

Example::

    import e2e_workloads as w
    w.SPACE_A4.size()            # 4
    w.SPACE_C64_QUICK.size()     # 4
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
from torch import nn

import retiarii as rt
from model_spaces.adapters import Adapter, AdapterAfterBlock, block_ends


@dataclass(frozen=True)
class Sizes:
    """One preset: the issue fixes images and model counts; the rest keeps a run of the
    modest 2-core CPU well under a minute (full) or a couple of seconds (quick)."""

    resnet_width: int = 16  # (a) ResNet-18's 64-128-256-512 at a quarter: 16-32-64-128
    a_images: int = 4096  # (a) 32x32 images (the issue's)
    a_epochs: int = 1  # (a) the issue measured 2; 1 keeps 8 heads apart under a minute
    b_width: int = 25  # (b) MobileNetV2 width multiplier, percent
    b_stages: tuple = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                       (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))  # MobileNetV2's 17 blocks
    b_adapters: int = 8  # (b) blocks an adapter may follow (the N = 8)
    b_images: int = 2048  # (b) the issue's
    c_examples: int = 8192  # (c) synthetic 64-feature examples
    c_acts: tuple = ("relu", "gelu", "tanh", "sigmoid")  # (c) 4 x 4 = 16 models
    c_epochs: int = 2
    d_stages: int = 2  # (d) searched stages: 2 x (kernel 2 x expansion 2 x SE 2) = 64 models
    d_per_class: int = 128  # (d) 4 classes of JPEGs
    d_epochs: int = 1
    e_models: int = 16  # (e) the demo, random search
    e_epochs: int = 3


FULL = Sizes()
QUICK = Sizes(resnet_width=8, a_images=256, a_epochs=1, b_width=25,
              b_stages=((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 1, 2)), b_adapters=2,
              b_images=128, c_examples=512, c_acts=("relu", "tanh"), c_epochs=1, d_stages=1,
              d_per_class=8, d_epochs=1, e_models=3, e_epochs=1)


def sizes(quick: bool) -> Sizes:
    return QUICK if quick else FULL


# ---- (a) heads on a frozen ResNet-18-style trunk --------------------------------------------


class BasicBlock(nn.Module):
    """ResNet's basic block: (B, cin, H, W) -> (B, cout, H/s, W/s), two 3x3 convs + shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 images (3x3 stem, no max-pool): (B, 3, 32, 32) -> (B, 8w) features."""

    def __init__(self, width: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        blocks, cin = [], width
        for mult, stride in ((1, 1), (2, 2), (4, 2), (8, 2)):
            blocks += [BasicBlock(cin, width * mult, stride), BasicBlock(width * mult, width * mult, 1)]
            cin = width * mult
        self.layers = nn.Sequential(*blocks)  # (B, w, 32, 32) -> (B, 8w, 4, 4)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.features = cin

    def forward(self, x):
        return torch.flatten(self.pool(self.layers(self.stem(x))), 1)


class HeadNet(nn.Module):
    """A frozen trunk (no weight trains; its BatchNorms normalize with batch statistics and
    update their running ones, as ``.train()`` makes them) and a trainable head."""

    def __init__(self, trunk: ResNet18, classes: int = 10):
        super().__init__()
        self.trunk = trunk.requires_grad_(False)
        self.head = nn.Linear(trunk.features, classes)

    def forward(self, x):
        return self.head(self.trunk(x))


def _mlp_head(features: int, hidden: tuple[int, ...], classes: int = 10) -> nn.Module:
    layers, width = [], features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, classes))


def heads_space(n: int, s: Sizes) -> rt.ModelSpace:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the frozen trunk's values: the same in every process
        net = HeadNet(ResNet18(s.resnet_width))
    f = net.trunk.features
    shapes = [(), (64,), (128,), (256,), (32,), (64, 64), (128, 128), (256, 64)]
    heads = {"linear" if not h else "mlp" + "x".join(map(str, h)): _mlp_head(f, h)
             for h in shapes[:n]}
    return rt.ModelSpace(net, [rt.apply_mutator("head", rt.mutators.OperatorMutator(
        heads, label="head"))], example_input=torch.randn(2, 3, 32, 32))


def _class_images(n: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise whose class shifts each colour channel's mean: (n, 3, size, size), (n,)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    shift = torch.randn(10, 3, 1, 1, generator=g)
    return torch.randn(n, 3, size, size, generator=g) + shift[y], y


# ---- (b) adapters on a frozen MobileNetV2 --------------------------------------------------


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand, 3x3 depthwise, 1x1 project (+ x when shapes allow)."""

    def __init__(self, cin: int, cout: int, stride: int, expansion: int):
        super().__init__()
        mid = cin * expansion
        layers = []
        if expansion != 1:
            layers += [nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU6()]
        layers += [nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid),
                   nn.ReLU6(), nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.body = nn.Sequential(*layers)  # (B, cin, H, W) -> (B, cout, H/s, W/s)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


class MobileNetV2(nn.Module):
    """stem -> inverted residuals -> 1x1 head conv; 32x32 images (stem stride 1)."""

    def __init__(self, width: int, stages, head: int = 320):
        super().__init__()

        def scaled(c):  # MobileNetV2's rounding to a multiple of 8, at least 8
            return max(8, (c * width + 400) // 800 * 8)

        cin = scaled(32)
        self.stem = nn.Sequential(nn.Conv2d(3, cin, 3, 1, 1, bias=False), nn.BatchNorm2d(cin),
                                  nn.ReLU6())
        blocks = []
        for expansion, channels, repeats, stride in stages:
            for i in range(repeats):
                blocks.append(InvertedResidual(cin, scaled(channels), stride if i == 0 else 1,
                                               expansion))
                cin = scaled(channels)
        self.layers = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.Conv2d(cin, head, 1, bias=False), nn.BatchNorm2d(head),
                                  nn.ReLU6())
        self.features = head


class AdapterNet(nn.Module):
    """The frozen backbone, pooling and a trainable classifier: (B, 3, H, W) -> (B, classes)."""

    def __init__(self, backbone: MobileNetV2, freeze: bool, classes: int = 10):
        super().__init__()
        # rt.freeze: BatchNorms use their running statistics (eval-mode, "truly frozen");
        # requires_grad_(False): what users usually write, BatchNorms still train-mode
        self.backbone = rt.freeze(backbone) if freeze else backbone.requires_grad_(False)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(backbone.features, classes)

    def forward(self, x):
        b = self.backbone
        return self.fc(self.pool(b.head(b.layers(b.stem(x)))).flatten(1))


def _calibrate(backbone: nn.Module) -> None:
    """Running statistics of a plausible scale (a pretrained network's): one train-mode pass
    of random images with momentum 1 sets each BatchNorm's to its input's."""
    bns = [m for m in backbone.modules() if isinstance(m, nn.BatchNorm2d)]
    for m in bns:
        m.momentum = 1.0
    with torch.no_grad():
        backbone.layers(backbone.stem(torch.randn(32, 3, 32, 32)))
        backbone.head(backbone.layers(backbone.stem(torch.randn(32, 3, 32, 32))))
    for m in bns:
        m.momentum = 0.1
        m.num_batches_tracked.zero_()


def adapter_space(freeze: bool, s: Sizes) -> rt.ModelSpace:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        backbone = MobileNetV2(s.b_width, s.b_stages)
        _calibrate(backbone)
        net = AdapterNet(backbone, freeze)
    ends = block_ends(net)
    # N blocks spread over the backbone: the models diverge at N depths
    chosen = [i * len(ends) // s.b_adapters for i in range(s.b_adapters)]
    adapters = [Adapter(net.backbone.layers[i].body[-1].num_features) for i in chosen]
    return rt.ModelSpace(net, [rt.apply_mutator([ends[i] for i in chosen],
                                                AdapterAfterBlock(adapters))],
                         example_input=torch.randn(2, 3, 32, 32))


# ---- (c) MLPs choosing their activations ---------------------------------------------------

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}


class MLP(nn.Module):
    """in -> W -> W -> classes, the activation after each hidden layer chosen by the space."""

    def __init__(self, width: int, acts: tuple[str, ...], features: int = 64, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(features, width)
        self.act1 = rt.LayerChoice({a: ACTIVATIONS[a]() for a in acts}, label="act1")
        self.fc2 = nn.Linear(width, width)
        self.act2 = rt.LayerChoice({a: ACTIVATIONS[a]() for a in acts}, label="act2")
        self.out = nn.Linear(width, classes)

    def forward(self, x):
        return self.out(self.act2(self.fc2(self.act1(self.fc1(x)))))


def mlp_space(width: int, s: Sizes) -> rt.ModelSpace:
    return rt.ModelSpace(MLP(width, s.c_acts), example_input=torch.randn(2, 64))


def _teacher(n: int, features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and the labels a random two-layer teacher gives them: (n, features), (n,)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (torch.tanh(x @ torch.randn(features, 32, generator=g)) @ torch.randn(32, 10, generator=g))
    return x, y.argmax(1)


# ---- (d) a MnasNet-like space on JPEGs -----------------------------------------------------


class SqueezeExcite(nn.Module):
    """x * sigmoid(W2 relu(W1 mean(x))): (B, C, H, W) -> (B, C, H, W)."""

    def __init__(self, channels, squeeze: int):
        super().__init__()
        self.reduce = rt.nn.Conv2d(channels, squeeze, 1)
        self.expand = rt.nn.Conv2d(squeeze, channels, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.expand(torch.relu(self.reduce(x.mean((2, 3), keepdim=True)))))


class SearchedMBConv(nn.Module):
    """MnasNet's searched layer: the depthwise kernel, the expansion ratio and squeeze-excite
    are choices (labelled ``{label}_kernel``, ``_expand``, ``_se``)."""

    def __init__(self, cin: int, cout: int, stride: int, label: str):
        super().__init__()
        kernel = rt.ValueChoice([3, 5], label=f"{label}_kernel")
        mid = rt.ValueChoice([3, 6], label=f"{label}_expand") * cin
        self.expand = nn.Sequential(rt.nn.Conv2d(cin, mid, 1, bias=False), rt.nn.BatchNorm2d(mid),
                                    nn.ReLU())
        self.depthwise = nn.Sequential(rt.nn.Conv2d(mid, mid, kernel, stride, kernel // 2,
                                                    groups=mid, bias=False),
                                       rt.nn.BatchNorm2d(mid), nn.ReLU())
        self.se = rt.LayerChoice({"none": nn.Identity(), "se": SqueezeExcite(mid, max(4, cin // 4))},
                                 label=f"{label}_se")
        self.project = nn.Sequential(rt.nn.Conv2d(mid, cout, 1, bias=False), rt.nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.project(self.se(self.depthwise(self.expand(x))))
        return x + y if self.residual else y


class MnasLike(nn.Module):
    """stem -> searched stages (one layer each, stride 2) -> head -> pool -> classifier."""

    def __init__(self, stages: int, classes: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16),
                                  nn.ReLU())  # (B, 3, 32, 32) -> (B, 16, 16, 16)
        widths = [16, 24, 40, 80][: stages + 1]
        self.stages = nn.Sequential(*[SearchedMBConv(widths[i], widths[i + 1], 2, f"s{i + 1}")
                                      for i in range(stages)])
        self.head = nn.Sequential(nn.Conv2d(widths[stages], 128, 1, bias=False),
                                  nn.BatchNorm2d(128), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(128, classes)

    def forward(self, x):
        return self.fc(self.pool(self.head(self.stages(self.stem(x)))).flatten(1))


def mnas_space(s: Sizes) -> rt.ModelSpace:
    return rt.ModelSpace(MnasLike(s.d_stages), example_input=torch.randn(2, 3, 32, 32))


def write_jpegs(root: str, per_class: int, classes: int = 4, size: int = 40, seed: int = 0) -> str:
    """An ImageFolder of JPEGs (``root/class<c>/<i>.jpg``): noise around a per-class colour,
    the same bytes for the same arguments. Returns ``root``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    colours = rng.uniform(40, 215, (classes, 3))
    for c in range(classes):
        os.makedirs(os.path.join(root, f"class{c}"), exist_ok=True)
        for i in range(per_class):
            pixels = np.clip(colours[c] + rng.normal(0, 50, (size, size, 3)), 0, 255)
            Image.fromarray(pixels.astype(np.uint8)).save(
                os.path.join(root, f"class{c}", f"{i:04d}.jpg"), quality=90)
    return root


def jpeg_trainer(root: str, s: Sizes) -> rt.ImageFolderTrainer:
    """The paper's setting: JPEGs decoded and augmented by DataLoader worker processes.
    JSON-describable, so workers rebuild it without a reference."""
    return rt.ImageFolderTrainer(dataset=root, image_size=32, batch_size=32, epochs=s.d_epochs,
                                 num_workers=1, optimizer="sgd", lr=0.05, val_fraction=0.125)


# ---- names made on first use ---------------------------------------------------------------


def _build(kind: str, case: str, s: Sizes, quick: bool):
    heads = re.fullmatch(r"A(\d+)", case)
    if kind == "SPACE":
        if heads:
            return heads_space(int(heads.group(1)) // (2 if quick else 1), s)  # quick: 2, 4
        if case in ("B", "BFREEZE"):
            return adapter_space(case == "BFREEZE", s)
        if case in ("C64", "C512"):
            return mlp_space(int(case[1:]), s)
        if case == "D":
            return mnas_space(s)
    elif kind == "TRAINER":
        if case == "A":
            return rt.Trainer(dataset=_class_images(s.a_images, 32, 1), batch_size=128,
                              epochs=s.a_epochs, val_fraction=0.0625, lr=3e-3)
        if case == "B":
            return rt.Trainer(dataset=_class_images(s.b_images, 32, 2), batch_size=32, epochs=1,
                              val_fraction=0.0625, optimizer="sgd", lr=0.01)
        if case == "C":
            return rt.Trainer(dataset=_teacher(s.c_examples, 64, 3), batch_size=64,
                              epochs=s.c_epochs, val_fraction=0.0625, lr=3e-3)
    raise AttributeError(f"e2e_workloads has no {kind.lower()} for workload {case!r}")


def __getattr__(name: str):
    match = re.fullmatch(r"(SPACE|TRAINER)_([A-Z0-9]+?)(_QUICK)?", name)
    if match is None:
        raise AttributeError(f"module 'e2e_workloads' has no attribute {name!r}")
    kind, case, quick = match.group(1), match.group(2), bool(match.group(3))
    obj = _build(kind, case, sizes(quick), quick)
    globals()[name] = obj  # module-level from now on: ref_of finds it by this name
    return obj
