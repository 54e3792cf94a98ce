"""A zoo of small but faithful architectures, written here, for the Graph IR tests and benchmark.

Each family is the real building block at toy width (a few channels, 8x8 to 32x32 inputs) so
the whole zoo traces, round-trips and runs on a CPU in seconds. :func:`cases` lists every model
as a :class:`Case`; :func:`resnet50` builds the full-size ResNet-50 layout for the benchmark.

Example::

    >>> for case in cases():
    ...     model = case.build()
    ...     graph = retiarii.trace(model, **case.trace_kwargs)
    ...     out = model(*case.inputs())
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from zoo_leaf import Activation, GatedConv, Scaler

# ---- ResNet (basic and bottleneck blocks) ---------------------------------------------------


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv3x3(cin, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(width, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride)  # stride on the 3x3, as in ResNet v1.5
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity  # in-place add, as torchvision writes it
        return self.relu(out)


class ResNet(nn.Module):
    """ResNet with a 7x7 stem, four stages of ``block`` and a linear head.

    Args:
        block: BasicBlock or Bottleneck.
        layers: blocks per stage, e.g. [3, 4, 6, 3] for ResNet-50.
        width: channels of the first stage (64 in the paper).
        num_classes: outputs of the head.
    """

    def __init__(self, block, layers: list[int], width: int = 64, num_classes: int = 1000):
        super().__init__()
        self.cin = width
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._stage(block, width, layers[0])
        self.layer2 = self._stage(block, width * 2, layers[1], stride=2)
        self.layer3 = self._stage(block, width * 4, layers[2], stride=2)
        self.layer4 = self._stage(block, width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)

    def _stage(self, block, width: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.cin != width * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.cin, width * block.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(width * block.expansion))
        layers = [block(self.cin, width, stride, downsample)]
        self.cin = width * block.expansion
        layers += [block(self.cin, width) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))  # (B, 3, H, W) -> (B, C, H/4, W/4)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)  # (B, 8C*e, h, w) -> (B, 8C*e)
        return self.fc(x)


def resnet50() -> ResNet:
    """The ResNet-50 layout: bottlenecks [3, 4, 6, 3], width 64, 1000 classes (25.6M weights)."""
    return ResNet(Bottleneck, [3, 4, 6, 3])


# ---- MobileNetV2 inverted residuals ---------------------------------------------------------


class ConvBNReLU6(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups,
                                   bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU6(inplace=True))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        layers: list[nn.Module] = [ConvBNReLU6(cin, hidden, 1)] if expand != 1 else []
        layers += [ConvBNReLU6(hidden, hidden, stride=stride, groups=hidden),  # depthwise
                   nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]  # linear
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        # (expand, cout, repeats, stride), a shortened version of the paper's table
        setting = [(1, 8, 1, 1), (6, 12, 2, 2), (6, 16, 2, 2)]
        layers: list[nn.Module] = [ConvBNReLU6(3, 8, stride=2)]
        cin = 8
        for t, c, n, s in setting:
            for i in range(n):
                layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        layers.append(ConvBNReLU6(cin, 32, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(32, num_classes))

    def forward(self, x):
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, 1)
        x = x.reshape(x.shape[0], -1)  # (B, 32, 1, 1) -> (B, 32)
        return self.classifier(x)


# ---- ShuffleNetV2 channel split and shuffle -------------------------------------------------


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    b, c, h, w = x.size()
    x = x.view(b, groups, c // groups, h, w)  # (B, C, H, W) -> (B, g, C/g, H, W)
    x = torch.transpose(x, 1, 2).contiguous()
    return x.view(b, -1, h, w)


class ShuffleUnit(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.stride = stride
        half = cout // 2
        if stride > 1:
            self.branch1 = nn.Sequential(
                nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False), nn.BatchNorm2d(cin),
                nn.Conv2d(cin, half, 1, bias=False), nn.BatchNorm2d(half), nn.ReLU(inplace=True))
        else:
            self.branch1 = nn.Sequential()
        branch_in = cin if stride > 1 else half
        self.branch2 = nn.Sequential(
            nn.Conv2d(branch_in, half, 1, bias=False), nn.BatchNorm2d(half), nn.ReLU(inplace=True),
            nn.Conv2d(half, half, 3, stride, 1, groups=half, bias=False), nn.BatchNorm2d(half),
            nn.Conv2d(half, half, 1, bias=False), nn.BatchNorm2d(half), nn.ReLU(inplace=True))

    def forward(self, x):
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)  # channel split: (B, C, H, W) -> 2 x (B, C/2, H, W)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8),
                                   nn.ReLU(inplace=True))
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.stage2 = nn.Sequential(ShuffleUnit(8, 16, 2), ShuffleUnit(16, 16, 1))
        self.stage3 = nn.Sequential(ShuffleUnit(16, 32, 2), ShuffleUnit(32, 32, 1))
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        x = self.stage3(self.stage2(self.maxpool(self.conv1(x))))
        return self.fc(x.mean([2, 3]))  # global pool as a tensor method


# ---- Inception branches ---------------------------------------------------------------------


class BasicConv(nn.Module):
    def __init__(self, cin: int, cout: int, **kwargs):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, bias=False, **kwargs)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)), inplace=True)


class InceptionA(nn.Module):
    def __init__(self, cin: int, pool_features: int):
        super().__init__()
        self.branch1x1 = BasicConv(cin, 8, kernel_size=1)
        self.branch5x5_1 = BasicConv(cin, 6, kernel_size=1)
        self.branch5x5_2 = BasicConv(6, 8, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv(cin, 8, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv(8, 12, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv(12, 12, kernel_size=(3, 3), padding=(1, 1))
        self.branch_pool = BasicConv(cin, pool_features, kernel_size=1)

    def forward(self, x):
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([b1, b5, b3, bp], 1)  # (B, 8+8+12+pool, H, W)


class Inception(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = BasicConv(3, 16, kernel_size=3, stride=2)
        self.mixed_a = InceptionA(16, pool_features=4)
        self.mixed_b = InceptionA(32, pool_features=8)
        self.dropout = nn.Dropout(p=0.3)
        self.fc = nn.Linear(36, num_classes)

    def forward(self, x):
        x = self.mixed_b(self.mixed_a(self.stem(x)))
        x = F.adaptive_avg_pool2d(x, (1, 1)).flatten(1)
        return self.fc(self.dropout(x))


# ---- DenseNet concatenation -----------------------------------------------------------------


class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int, bn_size: int = 4, drop_rate: float = 0.1):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)
        self.drop = nn.Dropout(drop_rate)

    def forward(self, features: list[torch.Tensor]):
        x = torch.cat(features, 1)  # concatenate every earlier feature map
        x = self.conv1(self.relu1(self.norm1(x)))
        return self.drop(self.conv2(self.relu2(self.norm2(x))))


class DenseBlock(nn.ModuleDict):
    def __init__(self, layers: int, cin: int, growth: int):
        super().__init__()
        for i in range(layers):
            self.add_module(f"denselayer{i + 1}", DenseLayer(cin + i * growth, growth))

    def forward(self, x):
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.add_module("norm", nn.BatchNorm2d(cin))
        self.add_module("relu", nn.ReLU(inplace=True))
        self.add_module("conv", nn.Conv2d(cin, cout, 1, bias=False))
        self.add_module("pool", nn.AvgPool2d(2, 2))


class DenseNet(nn.Module):
    def __init__(self, growth: int = 4, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("conv0", nn.Conv2d(3, 8, 3, padding=1, bias=False))
        self.features.add_module("denseblock1", DenseBlock(3, 8, growth))
        self.features.add_module("transition1", Transition(8 + 3 * growth, 10))
        self.features.add_module("denseblock2", DenseBlock(2, 10, growth))
        self.features.add_module("norm5", nn.BatchNorm2d(10 + 2 * growth))
        self.classifier = nn.Linear(10 + 2 * growth, num_classes)

    def forward(self, x):
        x = F.relu(self.features(x), inplace=True)
        x = torch.flatten(F.adaptive_avg_pool2d(x, (1, 1)), 1)
        return self.classifier(x)


# ---- SqueezeNet fire ------------------------------------------------------------------------


class Fire(nn.Module):
    def __init__(self, cin: int, squeeze: int, expand1x1: int, expand3x3: int):
        super().__init__()
        self.squeeze = nn.Conv2d(cin, squeeze, kernel_size=1)
        self.squeeze_activation = nn.ReLU(inplace=True)
        self.expand1x1 = nn.Conv2d(squeeze, expand1x1, kernel_size=1)
        self.expand1x1_activation = nn.ReLU(inplace=True)
        self.expand3x3 = nn.Conv2d(squeeze, expand3x3, kernel_size=3, padding=1)
        self.expand3x3_activation = nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.squeeze_activation(self.squeeze(x))
        return torch.cat([self.expand1x1_activation(self.expand1x1(x)),
                          self.expand3x3_activation(self.expand3x3(x))], 1)


class SqueezeNet(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, kernel_size=3, stride=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),
            Fire(16, 4, 8, 8), Fire(16, 4, 8, 8),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),
            Fire(16, 6, 12, 12))
        self.classifier = nn.Sequential(
            nn.Dropout(p=0.5), nn.Conv2d(24, num_classes, kernel_size=1), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d((1, 1)))

    def forward(self, x):
        return torch.flatten(self.classifier(self.features(x)), 1)


# ---- EfficientNet squeeze-excite ------------------------------------------------------------


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = nn.SiLU()
        self.scale_activation = nn.Sigmoid()

    def forward(self, x):
        scale = self.avgpool(x)  # (B, C, H, W) -> (B, C, 1, 1)
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(scale))))
        return scale * x


class MBConv(nn.Module):
    def __init__(self, cin: int, cout: int, expand: int, kernel: int, stride: int):
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.block = nn.Sequential(
            nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.SiLU(inplace=True),
            nn.Conv2d(hidden, hidden, kernel, stride, kernel // 2, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden), nn.SiLU(inplace=True),
            SqueezeExcite(hidden, max(1, cin // 4)),
            nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout, momentum=0.01, eps=1e-3))

    def forward(self, x):
        out = self.block(x)
        return out + x if self.use_res else out


class EfficientNet(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8),
                                  nn.SiLU(inplace=True))
        self.blocks = nn.Sequential(MBConv(8, 8, 1, 3, 1), MBConv(8, 12, 4, 5, 2),
                                    MBConv(12, 12, 4, 5, 1))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2, inplace=True),
                                  nn.Linear(12, num_classes))

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1))


# ---- Transformer encoder --------------------------------------------------------------------


class LayerScale(nn.Module):
    """A learned per-channel scale (CaiT): a module that holds a parameter and no submodule."""

    def __init__(self, dim: int, init: float = 1e-1):
        super().__init__()
        self.gamma = nn.Parameter(init * torch.ones(dim))

    def forward(self, x):
        return x * self.gamma


class EncoderBlock(nn.Module):
    """Pre-norm block with nn.MultiheadAttention, a GELU MLP and layer scale."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 2, dropout: float = 0.1):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(dim * mlp_ratio, dim), nn.Dropout(dropout))
        self.ls = LayerScale(dim)

    def forward(self, x):
        h = self.ln_1(x)
        h, _ = self.self_attention(h, h, h, need_weights=False)  # unpack the (out, weights) tuple
        x = x + self.dropout(h)
        return x + self.ls(self.mlp(self.ln_2(x)))


class VisionTransformer(nn.Module):
    """Patch embedding, a cls token, learned positions, two custom blocks and one
    nn.TransformerEncoderLayer."""

    def __init__(self, image: int = 16, patch: int = 4, dim: int = 16, heads: int = 2,
                 num_classes: int = 10):
        super().__init__()
        self.patch = patch
        self.conv_proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        seq = (image // patch) ** 2 + 1
        self.pos_embedding = nn.Parameter(torch.empty(1, seq, dim).normal_(std=0.02))
        self.layers = nn.ModuleList([EncoderBlock(dim, heads) for _ in range(2)])
        self.torch_layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=32,
                                                      dropout=0.1, batch_first=True,
                                                      norm_first=True, activation="gelu")
        self.ln = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        n = x.shape[0]
        x = self.conv_proj(x)  # (B, 3, H, W) -> (B, D, H/p, W/p)
        x = x.reshape(n, x.shape[1], -1).permute(0, 2, 1)  # -> (B, N, D)
        cls = self.class_token.expand(n, -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embedding  # (B, N+1, D)
        for layer in self.layers:
            x = layer(x)
        x = self.ln(self.torch_layer(x))
        return self.head(x[:, 0])


# ---- RNN text classifiers -------------------------------------------------------------------


class LSTMClassifier(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 12, hidden: int = 16, num_classes: int = 4):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim, padding_idx=0)
        self.rnn = nn.LSTM(dim, hidden, num_layers=2, batch_first=True, bidirectional=True,
                           dropout=0.2)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(4 * hidden, num_classes)

    def forward(self, tokens):
        out, (h_n, c_n) = self.rnn(self.embedding(tokens))  # out: (B, T, 2H)
        pooled = torch.cat([out[:, -1, :], out.max(dim=1).values], dim=-1)  # (B, 4H)
        return self.fc(self.drop(pooled))


class GRUClassifier(nn.Module):
    def __init__(self, vocab: int = 40, dim: int = 8, hidden: int = 12, num_classes: int = 3):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.gru = nn.GRU(dim, hidden, batch_first=False)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, tokens):
        x = self.embedding(tokens.t())  # (B, T) -> (T, B, D): time-major
        h_n = self.gru(x)[1]  # getitem on the (output, h_n) tuple
        return self.fc(h_n[-1])


# ---- U-Net skips ----------------------------------------------------------------------------


class DoubleConv(nn.Sequential):
    def __init__(self, cin: int, cout: int):
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, padding=1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class Up(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin // 2, kernel_size=2, stride=2)
        self.conv = DoubleConv(cin, cout)

    def forward(self, x, skip):
        x = self.up(x)  # (B, C, H, W) -> (B, C/2, 2H, 2W)
        return self.conv(torch.cat([skip, x], dim=1))


class UNet(nn.Module):
    def __init__(self, cin: int = 3, classes: int = 2, base: int = 4):
        super().__init__()
        self.inc = DoubleConv(cin, base)
        self.down1 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(base, base * 2))
        self.down2 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(base * 2, base * 4))
        self.up1 = Up(base * 4, base * 2)
        self.up2 = Up(base * 2, base)
        self.outc = nn.Conv2d(base, classes, kernel_size=1)

    def forward(self, x):
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        return self.outc(self.up2(self.up1(x3, x2), x1))


# ---- DARTS / NASNet-style cell --------------------------------------------------------------


class ReLUConvBN(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel: int = 1, stride: int = 1):
        super().__init__(nn.ReLU(inplace=False), nn.Conv2d(cin, cout, kernel, stride,
                                                           kernel // 2, bias=False),
                         nn.BatchNorm2d(cout, affine=False))


class SepConv(nn.Sequential):
    def __init__(self, c: int, kernel: int, dilation: int = 1):
        pad = dilation * (kernel - 1) // 2
        super().__init__(nn.ReLU(inplace=False),
                         nn.Conv2d(c, c, kernel, 1, pad, dilation=dilation, groups=c, bias=False),
                         nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c, affine=False))


class Zero(nn.Module):
    def forward(self, x):
        return x.mul(0.0)


class DartsCell(nn.Module):
    """Each intermediate node sums two edges from earlier nodes; the cell concatenates them."""

    # (operation, input node) pairs for each of the four intermediate nodes
    GENOTYPE = [[("sep_conv_3x3", 0), ("sep_conv_3x3", 1)],
                [("skip_connect", 0), ("dil_conv_3x3", 1)],
                [("max_pool_3x3", 0), ("zero", 2)],
                [("avg_pool_3x3", 1), ("sep_conv_5x5", 3)]]

    def __init__(self, c_pp: int, c_p: int, c: int):
        super().__init__()
        self.preprocess0 = ReLUConvBN(c_pp, c)
        self.preprocess1 = ReLUConvBN(c_p, c)
        ops = {"sep_conv_3x3": lambda: SepConv(c, 3), "sep_conv_5x5": lambda: SepConv(c, 5),
               "dil_conv_3x3": lambda: SepConv(c, 3, dilation=2), "skip_connect": nn.Identity,
               "max_pool_3x3": lambda: nn.MaxPool2d(3, 1, 1),
               "avg_pool_3x3": lambda: nn.AvgPool2d(3, 1, 1, count_include_pad=False),
               "zero": Zero}
        self.edges = nn.ModuleList(nn.ModuleList(ops[name]() for name, _ in node)
                                   for node in self.GENOTYPE)

    def forward(self, s0, s1):
        states = [self.preprocess0(s0), self.preprocess1(s1)]
        for node, edges in zip(self.GENOTYPE, self.edges):
            states.append(sum(op(states[j]) for (_, j), op in zip(node, edges)))
        return torch.cat(states[2:], dim=1)  # (B, 4c, H, W)


class DartsNet(nn.Module):
    def __init__(self, c: int = 4, cells: int = 3, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 3 * c, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(3 * c))
        c_pp, c_p = 3 * c, 3 * c
        self.cells = nn.ModuleList()
        for _ in range(cells):
            self.cells.append(DartsCell(c_pp, c_p, c))
            c_pp, c_p = c_p, 4 * c
        self.global_pooling = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(c_p, num_classes)

    def forward(self, x):
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        out = self.global_pooling(s1)
        return self.classifier(out.view(out.size(0), -1))


# ---- MLP with dropout -----------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...] = (20, 32, 16, 5), dropout: float = 0.25):
        super().__init__()
        layers: list[nn.Module] = []
        for a, b in zip(sizes[:-2], sizes[1:-1]):
            layers += [nn.Linear(a, b), nn.LayerNorm(b), nn.ReLU(), nn.Dropout(dropout)]
        self.body = nn.Sequential(*layers)
        self.out = nn.Linear(sizes[-2], sizes[-1])

    def forward(self, x):
        return F.log_softmax(self.out(self.body(x)), dim=-1)


# ---- IR features: several inputs and outputs, dicts, buffers, tied weights, shapes, leaves ----


class TwoTower(nn.Module):
    """Two inputs (one with a default), a dict output holding a tuple, a direct parameter and a
    persistent and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.5, -0.25, 0.125, 1.0]))
        self.register_buffer("step", torch.zeros((), dtype=torch.long), persistent=False)
        self.temperature = nn.Parameter(torch.tensor(0.07))
        self.left = nn.Linear(4, 6)
        self.right = nn.Sequential(nn.Linear(3, 6), nn.Tanh())

    def forward(self, a, b, scale: float = 2.0):
        za = F.normalize(self.left(a - self.mean), dim=-1)
        zb = F.normalize(self.right(b), dim=-1)
        logits = za @ zb.T / self.temperature.exp() * scale
        return {"logits": logits, "embeddings": (za, zb), "step": self.step + 1}


class DictIO(nn.Module):
    """A dict input, nested containers (ModuleDict of ModuleLists of Sequentials), a list output."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleDict({
            "image": nn.ModuleList([nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU()),
                                    nn.Sequential(nn.Conv2d(4, 4, 3), nn.Flatten())]),
            "meta": nn.ModuleList([nn.Linear(5, 8)]),
        })
        self.fuse = nn.Bilinear(4 * 4 * 4, 8, 3)

    def forward(self, batch: dict):
        img = batch["image"]
        for layer in self.heads["image"]:
            img = layer(img)
        meta = self.heads["meta"][0](batch["meta"].float())
        return [self.fuse(img, meta), img.sum(1, keepdim=True), meta.softmax(-1)]


class TiedLM(nn.Module):
    """A tiny language model whose output projection reuses the embedding weight."""

    def __init__(self, vocab: int = 30, dim: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.out_bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, tokens):
        h = self.norm(torch.relu(self.proj(self.embed(tokens))))
        return F.linear(h, self.embed.weight, self.out_bias)  # weight tying: (B, T, V)


class ShapeOps(nn.Module):
    """Arithmetic on x.shape / x.size(), getattr, tensor methods, slicing with Ellipsis and None."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        att = (q @ k.transpose(-2, -1)) * (k.size(-1) ** -0.5)  # (B, T, T)
        mask = att.new_ones(t, t, dtype=torch.bool).tril()  # torch.ones(t, t) fails on proxies
        att = att + torch.zeros_like(att, device=x.device)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).view(b * t, -1)[..., None, :2]
        return y.squeeze(-2).reshape(b, t, 2), x.dtype == torch.float32


class TensorOps(nn.Module):
    """Tensor constants made in forward, a buffer used on its own, interpolation, einsum,
    advanced indexing, dtype casts, in-place methods, non-finite floats, tuple-returning ops."""

    def __init__(self):
        super().__init__()
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.conv = nn.Conv2d(2, 2, 1)
        self.register_buffer("table", torch.arange(6.0).reshape(2, 3))

    def forward(self, x, unused=None):
        a = x + torch.tensor([1.0, 2.0]).view(1, 2, 1, 1)  # a constant: stored in the IR
        a = self.up(F.interpolate(a, scale_factor=0.5, mode="bilinear", align_corners=False))
        b = torch.einsum("bchw,c->bhw", a, torch.ones(2))
        c = a.permute(0, 2, 3, 1)[:, None, ..., ::2].to(torch.float64)  # (B, 1, H, W/2, C)
        d = torch.where(a > 0, a, a.new_zeros(()))
        e = F.pad(self.conv(d), (1, 1, 0, 0), value=-1.5).clamp(min=-1.0)
        f = e.type_as(x).flatten(start_dim=2).mean(-1, keepdim=True)
        g = self.table[:, 1:] @ torch.ones(2, 1)  # buffer-only math must stay a graph op
        h = x.new_tensor([3.5, float("inf")])
        top = torch.topk(f.squeeze(-1), 1)
        return b, c, d, g, h, (a.max(dim=1)[0], a.argmax(1), top.indices), e.abs_().add_(1)


class LeafNet(nn.Module):
    """User leaf modules: one @retiarii.leaf with data-dependent control flow, one undecorated
    class made a leaf through trace(leaf_modules=...), one leaf taking a function argument."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.gated = GatedConv(6, kernel_size=3, mode="sigmoid")
        self.act = Activation(torch.tanh)
        self.scaler = Scaler(6, init=0.5)

    def forward(self, x):
        x = self.act(self.gated(self.conv(x)))
        return self.scaler(x.mean((2, 3)))


class Flagged(nn.Module):
    """A forward that branches on a flag; traced with concrete_args={"return_features": True}."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(6, 6), nn.ReLU())
        self.fc = nn.Linear(6, 2)

    def forward(self, x, return_features: bool = False):
        f = self.features(x)
        out = self.fc(f)
        if return_features:
            return out, f
        return out


# ---- the list -------------------------------------------------------------------------------


@dataclass
class Case:
    """One zoo model.

    Args:
        name: a short identifier (used as the test id).
        factory: constructs the model; :meth:`build` calls it seeded, so two builds are equal.
        inputs: returns the example forward arguments (fresh tensors each call).
        trace_kwargs: extra arguments for ``retiarii.trace`` (leaf_modules, concrete_args).
    """

    name: str
    factory: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    trace_kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self) -> nn.Module:
        torch.manual_seed(0)
        return self.factory()


def _image(c: int = 3, size: int = 16, batch: int = 2) -> Callable[[], tuple]:
    return lambda: (torch.randn(batch, c, size, size, generator=torch.Generator().manual_seed(1)),)


def _tokens(vocab: int, shape=(3, 7)) -> Callable[[], tuple]:
    return lambda: (torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(2)),)


def _gen(seed: int = 3) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def cases() -> list[Case]:
    """Every zoo model with example inputs; see :class:`Case`."""
    return [
        Case("resnet_basic", lambda: ResNet(BasicBlock, [2, 1, 1, 1], width=4, num_classes=10),
             _image(size=32)),
        Case("resnet_bottleneck", lambda: ResNet(Bottleneck, [2, 1, 1, 1], width=4,
                                                 num_classes=10), _image(size=32)),
        Case("mobilenet_v2", MobileNetV2, _image(size=32)),
        Case("shufflenet_v2", ShuffleNetV2, _image(size=32)),
        Case("inception", Inception, _image(size=17)),
        Case("densenet", DenseNet, _image(size=8)),
        Case("squeezenet", SqueezeNet, _image(size=32)),
        Case("efficientnet_se", EfficientNet, _image(size=16)),
        Case("vit", VisionTransformer, _image(size=16)),
        Case("lstm_classifier", LSTMClassifier, _tokens(50)),
        Case("gru_classifier", GRUClassifier, _tokens(40, (2, 5))),
        Case("unet", UNet, _image(size=16, batch=1)),
        Case("darts_cell", DartsNet, _image(size=8)),
        Case("mlp_dropout", MLP, lambda: (torch.randn(4, 20, generator=_gen()),)),
        Case("two_tower", TwoTower, lambda: (torch.randn(3, 4, generator=_gen()),
                                             torch.randn(5, 3, generator=_gen(4)))),
        Case("dict_io", DictIO, lambda: ({"image": torch.randn(2, 1, 8, 8, generator=_gen()),
                                          "meta": torch.randint(0, 3, (2, 5),
                                                                generator=_gen(4))},)),
        Case("tied_lm", TiedLM, _tokens(30, (2, 6))),
        Case("shape_ops", ShapeOps, lambda: (torch.randn(2, 5, 8, generator=_gen()),)),
        Case("tensor_ops", TensorOps, lambda: (torch.randn(2, 2, 4, 4, generator=_gen()),)),
        Case("leaf_modules", LeafNet, _image(size=8), {"leaf_modules": [Scaler]}),
        Case("concrete_args", Flagged, lambda: (torch.randn(3, 6, generator=_gen()), True),
             {"concrete_args": {"return_features": True}}),
    ]


def case(name: str) -> Case:
    return next(c for c in cases() if c.name == name)
