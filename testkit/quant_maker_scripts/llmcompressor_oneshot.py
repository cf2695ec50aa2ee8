"""Runs inside the llm-compressor side venv (testkit/quant_makers.py builds it): llm-compressor's `oneshot` on a
tiny random checkpoint, saved as compressed-tensors. Imports nothing from this repository; everything it needs
comes on the command line:

    python llmcompressor_oneshot.py BASE_DIR OUT_DIR RECIPE_JSON

RECIPE_JSON is `testkit.quant_makers.Recipe` as a dict. Calibration is a handful of chat-templated sentences
tokenized in memory (no dataset download): the tower is not quantized, so text is all the calibration it needs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# Sentences for calibration: varied enough that every decoder linear sees activations of several directions.
SENTENCES = (
    "Tell me a story about a red fox that lives near the river.",
    "What is in this picture? A cat sits on a chair beside the window.",
    "The old bridge crossed the river near the market every morning.",
    "Name three colors and two animals, then count to ten.",
    "Farmers walked over the bridge with baskets of apples and bread.",
    "Describe the kitchen: a table, four chairs, a lamp and a clock.",
    "Children ran ahead to the school while the sun rose over the roof.",
    "Compare these two pictures and say which one is taller.",
    "A wide photo of the sea, the sky and a small boat with a sail.",
    "Write a short poem about winter, snow and a warm fire at night.",
    "The phone rang twice; nobody answered, so the message went to paper.",
    "Which is heavier, a book or a pen? Explain your answer briefly.",
)


def calibration_set(tokenizer: Any) -> Any:
    from datasets import Dataset

    ids = []
    for i, sentence in enumerate(SENTENCES):
        # two sentences a sample, as a user turn and an answer, so that the chat template's tokens are seen too
        answer = SENTENCES[(i + 5) % len(SENTENCES)]
        messages = [{"role": "user", "content": sentence}, {"role": "assistant", "content": answer}]
        ids.append(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
    ids = [list(x["input_ids"]) if isinstance(x, dict) else list(x) for x in ids]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})


def weight_args(recipe: dict[str, Any]) -> dict[str, Any]:
    grouped = recipe["group_size"] is not None
    return {
        "num_bits": recipe["weight_bits"],
        "type": "int",
        "symmetric": recipe["symmetric"],
        "strategy": "group" if grouped else "channel",
        "group_size": recipe["group_size"],
        "dynamic": False,
        "actorder": recipe["actorder"],
        "observer": recipe["observer"],
    }


def scheme(recipe: dict[str, Any]) -> dict[str, Any]:
    group: dict[str, Any] = {"targets": ["Linear"], "weights": weight_args(recipe)}
    if recipe["activation_bits"] is not None:  # dynamic per-token activations: no scale stored, none observed
        group["input_activations"] = {
            "num_bits": recipe["activation_bits"], "type": "int", "symmetric": True, "strategy": "token",
            "dynamic": True,
        }  # fmt: skip
    return {"config_groups": {"group_0": group}, "ignore": recipe["ignore"]}


def _skip_pinning_without_an_accelerator() -> None:
    """llm-compressor 0.14.0.1's AWQ pins its cached activations before each grid search
    (IntermediatesCache.pin_memory, for faster host-to-device copies); with no accelerator torch refuses to pin
    ("Cannot access accelerator device when none is available"). Pinning only speeds copies that a CPU run never
    makes, so without an accelerator it is skipped: the numbers computed are the same."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.accelerator.is_available():
        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None


def modifiers(recipe: dict[str, Any]) -> list[Any]:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    if recipe["algorithm"] == "gptq":
        return [GPTQModifier(**scheme(recipe))]
    if recipe["algorithm"] == "awq":
        from llmcompressor.modifiers.transform.awq import AWQModifier

        _skip_pinning_without_an_accelerator()
        # AWQ smooths (scales folded into the previous layer) and QuantizationModifier then rounds with those
        # scales: the recipe the library's AWQ examples use since AWQ moved under modifiers.transform.
        return [AWQModifier(duo_scaling=True), QuantizationModifier(**scheme(recipe))]
    raise ValueError(f"unknown algorithm {recipe['algorithm']!r}")


def main(base: Path, out: Path, recipe: dict[str, Any]) -> None:
    import importlib.metadata

    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(str(base), dtype=getattr(torch, recipe["dtype"]))
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    dataset = calibration_set(tokenizer)
    oneshot(
        model=model,
        processor=tokenizer,  # the tokenizer alone: AutoProcessor would want torchvision for the video processor
        dataset=dataset,
        recipe=modifiers(recipe),
        num_calibration_samples=len(dataset),
        max_seq_length=256,
        shuffle_calibration_samples=False,
        sequential_targets=recipe["sequential_targets"],
    )
    model.save_pretrained(str(out), save_compressed=True)
    versions = {name: importlib.metadata.version(name)
                for name in ("llmcompressor", "compressed-tensors", "transformers", "torch")}  # fmt: skip
    (out / "tool_versions.json").write_text(json.dumps(versions, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]))
