"""Checkpoints quantized by their publishers (AWQ, GPTQ, compressed-tensors), read as stored: base.py is the
contract between a format's reader and the loader.

`checkpoint_format` reads config.json's `quantization_config` at start-up, before a byte of weights: a format we
serve gets its reader, anything else raises `UnsupportedQuantization` naming the format and the field.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from vlm_engine.models.quant_formats.base import (
    ActivationQuantization,
    CheckpointFormat,
    GroupedWeights,
    UnsupportedQuantization,
)

__all__ = [
    "ActivationQuantization",
    "CheckpointFormat",
    "GroupedWeights",
    "UnsupportedQuantization",
    "checkpoint_format",
    "quantization_config_of",
]

# quant_method -> the module whose `parse(quantization_config) -> CheckpointFormat` reads it (imported when a
# checkpoint names it).
READERS = {
    "compressed-tensors": "vlm_engine.models.quant_formats.compressed_tensors",
    "awq": "vlm_engine.models.quant_formats.awq",
    "gptq": "vlm_engine.models.quant_formats.gptq",
}
# What the other methods are, for the error (the names Transformers' quantizers register).
KNOWN_UNSUPPORTED = {
    "fp8": "fp8 weights", "fbgemm_fp8": "fp8 weights", "modelopt": "NVIDIA ModelOpt (fp8 / NVFP4)",
    "nvfp4": "NVFP4", "mxfp4": "MXFP4", "exl2": "ExLlamaV2", "exl3": "ExLlamaV3", "bitsandbytes": "bitsandbytes",
    "hqq": "HQQ", "eetq": "EETQ", "aqlm": "AQLM", "quanto": "optimum-quanto", "torchao": "torchao",
    "higgs": "HIGGS", "vptq": "VPTQ", "spqr": "SpQR", "bitnet": "BitNet", "fbgemm": "fbgemm",
    "marlin": "a Marlin-only packing", "gptq_marlin": "a Marlin-only packing", "awq_marlin": "a Marlin-only packing",
}  # fmt: skip


def quantization_config_of(hf_config: Any) -> dict[str, Any] | None:
    """config.json's `quantization_config` (top level; a VLM's text config where only it has one), as a dict."""
    for holder in (hf_config, _text_config(hf_config)):
        if holder is None:
            continue
        found = (
            holder.get("quantization_config")
            if isinstance(holder, Mapping)
            else getattr(holder, "quantization_config", None)
        )
        if found:
            return found if isinstance(found, dict) else found.to_dict()
    return None


def checkpoint_format(hf_config: Any) -> CheckpointFormat | None:
    """The reader of the checkpoint's pre-quantized format, None for an unquantized checkpoint; raises
    UnsupportedQuantization for a format (or a field of one) that we do not serve."""
    config = quantization_config_of(hf_config)
    if config is None:
        return None
    method = str(config.get("quant_method", "")).lower()
    module_name = READERS.get(method)
    if module_name is None:
        what = KNOWN_UNSUPPORTED.get(method, "a format we do not read")
        raise UnsupportedQuantization(
            f"quantization_config.quant_method {method or None!r} ({what}) is not supported: "
            f"served are {', '.join(sorted(READERS))}"
        )
    return importlib.import_module(module_name).parse(config)


def _text_config(hf_config: Any) -> Any:
    if isinstance(hf_config, Mapping):
        return hf_config.get("text_config")
    return getattr(hf_config, "text_config", None)
