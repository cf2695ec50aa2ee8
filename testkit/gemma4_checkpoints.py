"""Deterministic, offline Gemma 4 text checkpoints (Gemma4ForCausalLM) for tests.

Random weights from the real `Gemma4TextConfig`, and Gemma 3's test tokenizer and chat template
(`testkit.gemma3_checkpoints`: the trained byte-level BPE with Gemma's specials; the text model does
not care which Gemma turn markup renders the prompt).

    cached_gemma4(preset="tiny" | "tiny-shared" | "tiny-moe", seed=0) -> Path
    cached_gemma4_vlm(preset="tiny" | "tiny-clipped" | "tiny-audio", seed=0) -> Path   (Gemma4ForConditionalGeneration)

"tiny": 6 layers (sliding, sliding, full) x 2 with a 16-token window; sliding heads of 16 dims and
2 KV heads, global heads of 32 dims with `attention_k_eq_v` and 1 global KV head; proportional RoPE
(a quarter of the frequencies turn) on the global layers; per-layer inputs of 8 per layer;
final logits soft-capped at 30.
"tiny-shared": the same with the last 3 layers KV-shared (they read layers 1 and 2's KV) and the
double-wide MLP on them.
"tiny-moe": "tiny" without per-layer inputs and with 4 routed experts (top 2) beside each dense MLP.
The VLM "tiny": the "tiny-shared" text model with `use_bidirectional_attention="vision"`, a 2-layer
vision tower (hidden 32, 16-px patches, 3x3 pooling) and the real Gemma4ImageProcessor at its smallest
budget (70 soft tokens an image: images are resized to at most 630 patches); its tokenizer adds
Gemma 4's image and audio markers, and the chat template writes the image token for an image part.
"tiny-clipped": the same with the tower's clipped linears and standardized outputs (stored buffers).
"tiny-audio": "tiny" with clipped linears in the tower and a 1-layer audio tower, as E2B / E4B carry one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testkit.checkpoints import RandomCheckpoint, _drop_load_time_kwargs, _train_bpe_tokenizer, cached_random_checkpoint
from testkit.gemma3_checkpoints import GEMMA3_CHAT_TEMPLATE, GEMMA3_SPECIAL_TOKENS, _build_tokenizer

SLIDING, FULL = "sliding_attention", "full_attention"
WINDOW = 16

_TINY: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
    "attention_k_eq_v": True, "max_position_embeddings": 1024, "sliding_window": WINDOW,
    "layer_types": [SLIDING, SLIDING, FULL] * 2, "hidden_size_per_layer_input": 8,
    "final_logit_softcapping": 30.0,
    "rope_parameters": {
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
}  # fmt: skip

GEMMA4_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"text": _TINY, "std": 0.2, "norm_std": 0.1, "dtype": "float32"},
    "tiny-shared": {
        "text": {**_TINY, "num_kv_shared_layers": 3, "use_double_wide_mlp": True},
        "std": 0.2,
        "norm_std": 0.1,
        "dtype": "float32",
    },
    # 26B-A4B's shape: no per-layer inputs, 4 experts of 32 (top 2) beside every dense MLP
    "tiny-moe": {
        "text": {
            **_TINY,
            "hidden_size_per_layer_input": 0,
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
        },
        "std": 0.2,
        "norm_std": 0.1,
        "dtype": "float32",
    },
}


def gemma4_text_config(spec: dict[str, Any], token_ids: dict[str, int], vocab_size: int) -> Any:
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        **spec["text"],
        vocab_size=vocab_size,
        vocab_size_per_layer_input=vocab_size,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        # Untied, as the tiny Gemma 3: a tied tiny model's greedy tokens repeat the prompt's last one.
        tie_word_embeddings=spec.get("tie_word_embeddings", False),
        bos_token_id=token_ids["<bos>"],
        eos_token_id=[token_ids["<eos>"], token_ids["<end_of_turn>"]],
        pad_token_id=token_ids["<pad>"],
        architectures=["Gemma4ForCausalLM"],
    )


# Stored buffers of the vision tower (use_clipped_linears, standardize) and their values: bound +- 1 + N(0, 0.1)
# (they clip: the tiny tower's activations reach past 1), standardization shift N(0, 0.1), scale 1 + N(0, 0.1).
_BUFFER_INIT = {
    "input_min": (-1.0, 0.1), "output_min": (-1.0, 0.1), "input_max": (1.0, 0.1), "output_max": (1.0, 0.1),
    "std_bias": (0.0, 0.1), "std_scale": (1.0, 0.1),
}  # fmt: skip


def _init_deterministically(model: Any, std: float, norm_std: float, seed: int) -> None:
    """Every parameter, then each layer's `layer_scalar` and the tower's stored buffers, from one seeded
    generator: matrices and embeddings N(0, std); RMSNorm scales, the layer scalars and the router's
    scales 1 + N(0, norm_std)."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    stored = [(n, b) for n, b in model.named_buffers() if n.endswith("layer_scalar")]
    clipped = [(n, b) for n, b in model.named_buffers() if n.rpartition(".")[2] in _BUFFER_INIT]
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + stored:
            scaled = "norm" in name.rsplit(".", 2)[-2] or name.endswith(("layer_scalar", "scale"))
            values = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            tensor.copy_(values * norm_std + 1.0 if scaled else values * std)
        for name, tensor in clipped:
            base, spread = _BUFFER_INIT[name.rpartition(".")[2]]
            tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * spread + base)


def _model(config: Any, dtype: Any) -> Any:
    from transformers import Gemma4ForCausalLM

    return Gemma4ForCausalLM._from_config(config, dtype=dtype)


GEMMA4_BUILDER_VERSION = 1

GEMMA4 = RandomCheckpoint(
    f"gemma4-text-b{GEMMA4_BUILDER_VERSION}",
    GEMMA4_PRESETS,
    build_tokenizer=_build_tokenizer,
    token_names=GEMMA3_SPECIAL_TOKENS,
    config=lambda spec, token_ids, tokenizer: gemma4_text_config(spec, token_ids, len(tokenizer)),
    model=_model,
    init=lambda model, spec, seed: _init_deterministically(model, spec["std"], spec["norm_std"], seed),
    generation=lambda ids: {
        "bos_token_id": ids["<bos>"], "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]], "pad_token_id": ids["<pad>"],
    },
    processor=lambda spec, tokenizer: tokenizer,  # a text model: its tokenizer is all the prompt side
)  # fmt: skip


def cached_gemma4(preset: str = "tiny", seed: int = 0, cache_root: Path | None = None) -> Path:
    return cached_random_checkpoint(GEMMA4, preset, seed, cache_root)


# ---- the VLM --------------------------------------------------------------------------------------------

# Named as Gemma 4's tokenizer names them (begin / end of image, the image soft token, and audio's).
GEMMA4_MARKERS = {
    "boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
    "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>",
}  # fmt: skip
# "<|video|>" too: Gemma4Processor adds it to the tokenizer, which must not outgrow the model's vocabulary.
GEMMA4_VLM_TOKENS: tuple[str, ...] = (*GEMMA3_SPECIAL_TOKENS[:5], *GEMMA4_MARKERS.values(), "<|video|>")
# Gemma 3's test template with the image token for an image part (the processor expands it).
GEMMA4_CHAT_TEMPLATE = GEMMA3_CHAT_TEMPLATE.replace("<start_of_image>", GEMMA4_MARKERS["image_token"])

GEMMA4_VLM_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "text": {**GEMMA4_PRESETS["tiny-shared"]["text"], "use_bidirectional_attention": "vision"},
        "vision": {
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 16, "position_embedding_size": 64, "patch_size": 16,
            "pooling_kernel_size": 3,
        },
        "max_soft_tokens": 70,
        "std": 0.2,
        "norm_std": 0.1,
        "dtype": "float32",
    },
}  # fmt: skip
# The released towers' stored buffers: clipped linears (E2B / E4B) and standardized outputs (26B / 31B).
GEMMA4_VLM_PRESETS["tiny-clipped"] = {
    **GEMMA4_VLM_PRESETS["tiny"],
    "vision": {**GEMMA4_VLM_PRESETS["tiny"]["vision"], "use_clipped_linears": True, "standardize": True},
}
# E2B / E4B's shape: an audio tower beside the vision tower (Transformers' Gemma4AudioModel, as small as it
# builds; its other values are Gemma4AudioConfig's defaults, the released ones). Text and image prompts never
# run it, in Transformers or here: the checkpoint carries its tensors, which our model skips.
GEMMA4_VLM_PRESETS["tiny-audio"] = {
    **GEMMA4_VLM_PRESETS["tiny"],
    "vision": {**GEMMA4_VLM_PRESETS["tiny"]["vision"], "use_clipped_linears": True},
    "audio": {
        "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "subsampling_conv_channels": [8, 4],
        "output_proj_dims": 48,
    },
}  # fmt: skip


def _build_vlm_tokenizer(staging: Path) -> Any:
    from tokenizers import AddedToken

    tok = _train_bpe_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA4_VLM_TOKENS])
    return _saved_vlm_tokenizer(tok, staging)


def _saved_vlm_tokenizer(tok: Any, staging: Path) -> Any:
    """`tok` (a `tokenizers.Tokenizer` holding Gemma 4's specials) written to `staging` with the markers named
    (Gemma4Processor reads them from the tokenizer) and loaded back with the test chat template."""
    from transformers import AutoTokenizer

    staging.mkdir(parents=True, exist_ok=True)
    tok.save(str(staging / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": None, "extra_special_tokens": GEMMA4_MARKERS, "clean_up_tokenization_spaces": False,
        "model_max_length": 131072, "padding_side": "left",
    }  # fmt: skip
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(staging))
    tokenizer.chat_template = GEMMA4_CHAT_TEMPLATE
    _drop_load_time_kwargs(tokenizer)
    return tokenizer


def gemma4_vlm_config(spec: dict[str, Any], token_ids: dict[str, int], vocab_size: int) -> Any:
    from transformers import Gemma4Config

    text = gemma4_text_config(spec, token_ids, vocab_size).to_dict()
    return Gemma4Config(
        text_config=text,
        vision_config=spec["vision"],
        audio_config=spec.get("audio"),
        image_token_id=token_ids[GEMMA4_MARKERS["image_token"]],
        boi_token_id=token_ids[GEMMA4_MARKERS["boi_token"]],
        eoi_token_id=token_ids[GEMMA4_MARKERS["eoi_token"]],
        audio_token_id=token_ids[GEMMA4_MARKERS["audio_token"]],
        boa_token_id=token_ids[GEMMA4_MARKERS["boa_token"]],
        eoa_token_index=token_ids[GEMMA4_MARKERS["eoa_token"]],
        tie_word_embeddings=spec.get("tie_word_embeddings", False),
        architectures=["Gemma4ForConditionalGeneration"],
        eos_token_id=[token_ids["<eos>"], token_ids["<end_of_turn>"]],
    )


def _vlm_model(config: Any, dtype: Any) -> Any:
    from transformers import Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration._from_config(config, dtype=dtype)


def _vlm_processor(spec: dict[str, Any], tokenizer: Any) -> Any:
    from transformers import Gemma4AudioFeatureExtractor, Gemma4ImageProcessor, Gemma4Processor, Gemma4VideoProcessor

    budget = spec["max_soft_tokens"]
    return Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessor(max_soft_tokens=budget),
        tokenizer=tokenizer,
        video_processor=Gemma4VideoProcessor(),
        chat_template=GEMMA4_CHAT_TEMPLATE,
        image_seq_length=budget,
    )


GEMMA4_VLM_BUILDER_VERSION = 2

GEMMA4_VLM = RandomCheckpoint(
    f"gemma4-vlm-b{GEMMA4_VLM_BUILDER_VERSION}",
    GEMMA4_VLM_PRESETS,
    build_tokenizer=_build_vlm_tokenizer,
    token_names=GEMMA4_VLM_TOKENS,
    config=lambda spec, token_ids, tokenizer: gemma4_vlm_config(spec, token_ids, len(tokenizer)),
    model=_vlm_model,
    init=lambda model, spec, seed: _init_deterministically(model, spec["std"], spec["norm_std"], seed),
    generation=GEMMA4.generation,
    processor=_vlm_processor,
)


def cached_gemma4_vlm(preset: str = "tiny", seed: int = 0, cache_root: Path | None = None) -> Path:
    return cached_random_checkpoint(GEMMA4_VLM, preset, seed, cache_root)


# ---- the benchmark VLM (issue 52) ------------------------------------------------------------------------

# gemma-4-E4B-it's layer shapes (tests/released_configs.py GEMMA4_TEXT / GEMMA4_VISION_SMALL, which
# tests/test_gemma4_family.py checks these against) with the testkit's small vocabulary: 42 layers of 2560, 8
# heads of 256 (sliding, window 512) / 512 (global), 2 KV heads, the last 18 layers reading earlier layers' KV,
# per-layer inputs of 256, tied; the small models' tower (16 layers of 768, clipped linears) at the processor's
# default budget of 280 soft tokens an image. bf16, about 8 GB. No audio tower: a benchmark of images.
GEMMA4_E4B_TEXT: dict[str, Any] = {
    "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 42, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 256, "global_head_dim": 512, "sliding_window": 512,
    "num_kv_shared_layers": 18, "use_double_wide_mlp": False, "hidden_size_per_layer_input": 256,
    "layer_types": ([SLIDING] * 5 + [FULL]) * 7, "final_logit_softcapping": 30.0,
    "max_position_embeddings": 131072, "use_bidirectional_attention": "vision",
    "rope_parameters": {
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
}  # fmt: skip
GEMMA4_E4B_VISION: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 16, "num_attention_heads": 12,
    "num_key_value_heads": 12, "head_dim": 64, "patch_size": 16, "pooling_kernel_size": 3,
    "position_embedding_size": 10240, "standardize": False, "use_clipped_linears": True,
}  # fmt: skip
GEMMA4_BENCH_PRESETS: dict[str, dict[str, Any]] = {
    "bench-e4b": {
        # default_output_length: the released vision configs' budget field, which vLLM reads (Transformers 5.25's
        # class no longer defines it, and keeps it as an extra attribute)
        "text": GEMMA4_E4B_TEXT, "vision": {**GEMMA4_E4B_VISION, "default_output_length": 280},
        "max_soft_tokens": 280, "tie_word_embeddings": True,
        "std": 0.02, "norm_std": 0.02, "dtype": "bfloat16",
    },
}  # fmt: skip
SPM_VOCAB_SIZE = 4096


def _train_spm_bpe() -> Any:
    """A SentencePiece-style BPE as Gemma's tokenizer.json holds one (spaces normalized to U+2581, merges over
    whole lines, 256 byte-fallback tokens, decoded by Replace + ByteFallback + Fuse), trained on the testkit's
    fixed corpus. llama.cpp's converter reads Gemma 4's vocabulary only in this form (a byte-level BPE is
    refused), so the benchmark checkpoint needs it on every side."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    from testkit.checkpoints import _tokenizer_corpus

    def pipeline(tok: Any) -> Any:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")  # llama.cpp's gemma4 split
        return tok

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    reserved = len(GEMMA4_VLM_TOKENS) + 1 + len(byte_tokens)  # the specials, <unk>, the bytes
    trained = pipeline(Tokenizer(BPE()))
    trainer = trainers.BpeTrainer(vocab_size=SPM_VOCAB_SIZE - reserved, min_frequency=2, show_progress=False)
    trained.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    head = [*GEMMA4_VLM_TOKENS, "<unk>", *byte_tokens]
    pieces = [p for p in sorted(model["vocab"], key=model["vocab"].__getitem__) if p not in head]
    vocab = {piece: i for i, piece in enumerate(head + pieces)}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = pipeline(Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA4_VLM_TOKENS])
    return tok


GEMMA4_BENCH_BUILDER_VERSION = 1

GEMMA4_BENCH = RandomCheckpoint(
    f"gemma4-bench-b{GEMMA4_BENCH_BUILDER_VERSION}",
    GEMMA4_BENCH_PRESETS,
    build_tokenizer=lambda staging: _saved_vlm_tokenizer(_train_spm_bpe(), staging),
    token_names=GEMMA4_VLM_TOKENS,
    config=GEMMA4_VLM.config,
    model=_vlm_model,
    init=GEMMA4_VLM.init,
    generation=GEMMA4.generation,
    processor=_vlm_processor,
)


def cached_gemma4_bench(preset: str = "bench-e4b", seed: int = 0, cache_root: Path | None = None) -> Path:
    return cached_random_checkpoint(GEMMA4_BENCH, preset, seed, cache_root)
