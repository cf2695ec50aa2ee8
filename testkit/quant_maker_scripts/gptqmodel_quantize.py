"""Runs inside the GPTQModel side venv (testkit/quant_makers.py builds it): GPTQModel quantizes a tiny random
checkpoint into its native formats, GPTQ (`quant_method: gptq`, qweight / qzeros / scales / g_idx) or AWQ's GEMM
packing (`quant_method: awq`), then writes beside it the same weights dequantized to fp32 by the tool's own code
(the reference Transformers runs: it cannot load these formats without GPTQModel). Imports nothing from this
repository:

    python gptqmodel_quantize.py BASE_DIR OUT_DIR RECIPE_JSON

RECIPE_JSON is `testkit.quant_makers.Recipe` as a dict; its "reference" names OUT_DIR's subdirectory for the twin's
weights (the caller writes its config, once it has aligned the checkpoint's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from llmcompressor_oneshot import SENTENCES  # the same calibration text for both tools


class _TextProcessor:
    """What GPTQModel's Qwen-VL calibration asks of the processor, for text: the chat template and tokenizing."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def __call__(self, text: Any, images: Any = None, videos: Any = None, **kwargs: Any) -> Any:
        assert images is None and videos is None, "text calibration only"
        return self.tokenizer(text, **kwargs)


def _text_calibration() -> None:
    """GPTQModel calibrates Qwen-VL through the checkpoint's whole processor, whose video processor wants torchvision
    (absent here: PyPI's build links CUDA torch). Text calibration needs the tokenizer and its chat template only."""
    from gptqmodel.models.definitions.base_qwen2_vl import BaseQwen2VLGPTQ
    from transformers import AutoTokenizer

    BaseQwen2VLGPTQ.load_processor = lambda self: _TextProcessor(AutoTokenizer.from_pretrained(self.model_local_path))
    BaseQwen2VLGPTQ.require_load_processor = False


def quantize(base: Path, out: Path, recipe: dict[str, Any]) -> None:
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.quantization.config import FORMAT, METHOD
    from gptqmodel.utils.backend import BACKEND

    awq = recipe["algorithm"] == "awq"
    config = QuantizeConfig(
        bits=recipe["weight_bits"], group_size=recipe["group_size"] or -1, sym=recipe["symmetric"],
        desc_act=recipe["actorder"] == "group", device="cpu",
        quant_method=METHOD.AWQ if awq else METHOD.GPTQ, format=FORMAT.GEMM if awq else FORMAT.GPTQ,
    )  # fmt: skip
    model = GPTQModel.load(str(base), config, dtype=getattr(torch, recipe["dtype"]))
    # AWQ's default kernel choice wants CUDA; its torch kernel packs on the CPU (fp16 / bf16 models only).
    model.quantize(list(SENTENCES), batch_size=1, backend=BACKEND.AWQ_TORCH if awq else BACKEND.AUTO)
    model.save(str(out))


def dequantized_weights(out: Path, recipe: dict[str, Any]) -> dict[str, Any]:
    """Each quantized linear's weight [out, in] in fp32, by GPTQModel's own unpacking: AWQ through
    `dequantize_gemm`, GPTQ through its torch kernel's `dequantize_weight` on the model GPTQModel loads (which also
    undoes the v1 format's zero-point offset); the scales cast to fp32 first, so that (q - z) * s is rounded once,
    in fp32."""
    import torch
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    if recipe["algorithm"] == "awq":
        tensors = _tensors(out)
        return {name.removesuffix(".qweight"): dequantize_gemm(
                    tensors[name], tensors[name.replace(".qweight", ".qzeros")],
                    tensors[name.replace(".qweight", ".scales")].float(), recipe["weight_bits"], recipe["group_size"],
                ).T.contiguous()
                for name in tensors if name.endswith(".qweight")}  # fmt: skip
    from gptqmodel import GPTQModel
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.utils.backend import BACKEND

    model = GPTQModel.load(str(out), backend=BACKEND.GPTQ_TORCH, device="cpu", dtype=torch.float16)
    weights = {}
    for name, module in model.model.named_modules():
        if isinstance(module, TorchLinear):
            module.scales = module.scales.to(torch.float32)
            weights[name] = module.dequantize_weight().T.to(torch.float32).contiguous()
    return weights


def _tensors(out: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def write_reference(out: Path, recipe: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import save_file

    packed = (".qweight", ".qzeros", ".scales", ".g_idx")
    tensors = {n: t.to(torch.float32) for n, t in _tensors(out).items() if not n.endswith(packed)}
    tensors.update({f"{name}.weight": w for name, w in dequantized_weights(out, recipe).items()})
    reference = out / recipe["reference"]
    reference.mkdir()
    save_file(tensors, str(reference / "model.safetensors"), metadata={"format": "pt"})  # its config: the caller's


def main(base: Path, out: Path, recipe: dict[str, Any]) -> None:
    import importlib.metadata

    _text_calibration()
    quantize(base, out, recipe)
    write_reference(out, recipe)
    versions = {name: importlib.metadata.version(name) for name in ("gptqmodel", "transformers", "torch")}
    (out / "tool_versions.json").write_text(json.dumps(versions, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]))
