"""placard-default: EfficientNet-Lite0's labels feeding SmolLM2-135M (real weights, fp32, greedy).

Checks that it sees (a cat photo gives a cat, the coffee photo coffee or a cup), that a batch of
8 photos equals each alone, that it equals a plain reference composition (the classifier in
torch, the label text's embeddings fed to Transformers' SmolLM2 through `inputs_embeds`), and
that the prefix cache reuses an image's span only for the same image."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_engine import Engine, SamplingParams

pytestmark = pytest.mark.slow

QUESTION = "Write a short museum placard for this picture."
GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


def photo(name: str) -> Image.Image:
    import skimage.data

    pixels = getattr(skimage.data, name)()
    if pixels.ndim == 2:
        pixels = np.stack([pixels] * 3, axis=-1)
    return Image.fromarray(pixels.astype(np.uint8)).convert("RGB")


def ask(image: Image.Image, question: str = QUESTION) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(dtype="float32", kv_cache_tokens=16384, numerics="exact")  # no model: the embedded default


def test_default_model_is_placard(engine: Engine) -> None:
    assert engine.source.name == "placard-default"
    assert type(engine.model).__name__ == "PlacardForConditionalGeneration"


def test_it_sees_the_cat_and_the_coffee(engine: Engine) -> None:
    cat, coffee = engine.chat([ask(photo("chelsea")), ask(photo("coffee"))], GREEDY)
    assert "cat" in cat.text.lower(), cat.text
    assert any(word in coffee.text.lower() for word in ("coffee", "cup", "espresso")), coffee.text


def test_a_batch_of_eight_photos_equals_each_alone(engine: Engine) -> None:
    names = ["chelsea", "coffee", "astronaut", "rocket", "camera", "coins", "moon", "hubble_deep_field"]
    convs = [ask(photo(n)) for n in names]
    batched = engine.chat(convs, GREEDY)
    alone = [engine.chat([c], GREEDY)[0] for c in convs]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in batched}) >= 6  # different photos, different answers


def test_equals_the_reference_composition_in_transformers(engine: Engine) -> None:
    """The classifier and the label text rebuilt here; SmolLM2 run by Transformers on inputs_embeds."""
    from torchvision.models import EfficientNet_B0_Weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vlm_engine.models.families.placard.efficientnet_lite import load_efficientnet_lite0, preprocess

    source = engine.source
    tokenizer = AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.gguf_file)
    hf = AutoModelForCausalLM.from_pretrained(str(source.directory), gguf_file=source.gguf_file, dtype=torch.float32)
    classifier = load_efficientnet_lite0()
    categories = EfficientNet_B0_Weights.IMAGENET1K_V1.meta["categories"]
    for name in ("chelsea", "coffee"):
        image = photo(name)
        with torch.inference_mode():
            probs = classifier(preprocess(image)[None]).softmax(-1)[0]
        top = probs.topk(3)
        labels = " " + ", ".join(f"{categories[i]} ({round(100 * float(p))}%)" for p, i in zip(top.values, top.indices)) + "."
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "\x00" + QUESTION}], add_generation_prompt=True, tokenize=False
        )
        before, after = rendered.split("\x00")
        pieces = [before, "A picture. An image classifier says it shows:", labels, "\n", after]
        ids = [t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False)]
        with torch.inference_mode():
            embeds = hf.get_input_embeddings()(torch.tensor([ids]))
            expected = hf.generate(
                inputs_embeds=embeds, attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=40, do_sample=False
            )[0].tolist()
        ours = engine.chat([ask(image)], GREEDY)[0]
        assert ours.token_ids == expected, (name, ours.text)


def test_the_prefix_cache_reuses_only_the_same_image(engine: Engine) -> None:
    engine.pool.reset_prefix_cache()
    question = "Describe the picture, then say what period it is from. " * 4  # > 1 page after the image
    first = engine.chat([ask(photo("chelsea"), question)], GREEDY)[0]
    again = engine.chat([ask(photo("chelsea"), question)], GREEDY)[0]
    other = engine.chat([ask(photo("coffee"), question)], GREEDY)[0]
    assert first.cached_tokens < again.cached_tokens
    assert again.token_ids == first.token_ids
    image_start = engine.process_messages(ask(photo("coffee"), question)).media[0].span.offset
    assert other.cached_tokens <= image_start  # only the system prompt before the image is shared


def test_a_video_of_the_cat_is_about_a_cat(engine: Engine) -> None:
    from testkit.videos import make_clip

    # A 3 s clip panning across the cat photo; every sampled frame is labelled with its time.
    clip = make_clip(width=320, height=240, fps=10, seconds=3, picture=photo("chelsea"))
    conv = [{"role": "user", "content": [{"type": "video", "video": clip}, {"type": "text", "text": "What does this video show?"}]}]
    prompt = engine.process_messages(conv, mm_processor_kwargs={"fps": 1})
    assert [m.kind for m in prompt.media] == ["video"]
    span_text = engine.tokenizer.decode(prompt.media[0].pixel_values.tolist())
    assert span_text.count(" At ") == 3 and "cat" in span_text, span_text  # 3 frames at 1 fps, each labelled
    out = engine.chat([conv], GREEDY, mm_processor_kwargs={"fps": 1})[0]
    assert "cat" in out.text.lower(), out.text
