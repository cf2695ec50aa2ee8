"""Gemma 4 beyond the family matrix (its VLM row: tests/family_table.py). The text model
(Gemma4ForCausalLM) on tiny random checkpoints (testkit/gemma4_checkpoints.py: a 16-token window on 4
of 6 layers, global layers with their own head dim, k_eq_v, proportional RoPE, per-layer inputs,
soft-capped logits; "tiny-shared" adds KV sharing on the last 3 layers and the double-wide MLP there;
"tiny-moe" routed experts beside the dense MLPs): greedy tokens = Transformers' `generate` in fp32 for prompts
shorter and longer than the window and multi-turn, batched = alone, prefix cache on = off,
chunked prefill and preemption; the KV-shared layers hold no pages of their own; the KV bytes a
token of a Gemma-4-E4B-shaped model takes with and without KV sharing, from the runner's pools;
the released E2B / E4B text configs' names on the meta device; audio parts refused by name; a vision
tower with the released towers' stored buffers (clipped linears, standardization) exact; the released
E2B-it / E4B-it full checkpoints' names on meta with their audio tower skipped unread, and a tiny checkpoint
with an audio tower ("tiny-audio") = Transformers on text and an image, its audio parts still refused."""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
import torch

from testkit.gemma4_checkpoints import WINDOW, cached_gemma4, cached_gemma4_vlm
from tests.conftest import hf_greedy
from tests.family_table import base_conversations, meta_model
from tests.released_configs import GEMMA4_AUDIO_RELEASES, GEMMA4_TEXT, gemma4_text_config, released_checkpoint
from tests.test_fast_numerics import greedy_agreement
from vlm_engine import Engine, SamplingParams
from vlm_engine.attention.backends import create_backend
from vlm_engine.models import loader
from vlm_engine.models.families.gemma4.vision import AUDIO_CHECKPOINT_PREFIXES
from vlm_engine.runner.model_runner import ModelRunner, kv_token_bytes

PRESETS = ("tiny", "tiny-shared", "tiny-moe")
AUDIO_PART = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
MAX_TOKENS = 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
LONG_TEXT = (
    "The old bridge crossed the river near the market, and every morning the farmers walked over it "
    "with their baskets of apples, bread and flowers while the children ran ahead to the school."
)
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Tell me a story about a red fox."}],
    [{"role": "user", "content": LONG_TEXT}],  # several windows long
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name three colors."},
        {"role": "assistant", "content": "Red, green, blue."},
        {"role": "user", "content": "Two more?"},
    ],
]


@functools.cache
def engine(preset: str, **options: Any) -> Engine:
    kwargs: dict[str, Any] = {"dtype": "float32", "kv_cache_tokens": 2048, "numerics": "exact", **options}
    return Engine(str(cached_gemma4(preset)), **kwargs)


@functools.cache
def references(preset: str) -> tuple[list[int], ...]:
    """Transformers' fp32 greedy tokens for each conversation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(cached_gemma4(preset))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    out = []
    for conv in CONVERSATIONS:
        ids = tokenizer.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            tokens = model.generate(ids["input_ids"], max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(tokens[0, ids["input_ids"].shape[1] :].tolist())
    return tuple(out)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_equals_transformers_alone_and_batched(preset: str) -> None:
    eng = engine(preset)
    assert len(eng.process_messages(CONVERSATIONS[1]).token_ids) > 2 * WINDOW  # crosses the window
    want = list(references(preset))
    assert [eng.chat([c], GREEDY)[0].token_ids for c in CONVERSATIONS] == want
    assert [o.token_ids for o in eng.chat(CONVERSATIONS, GREEDY)] == want


@pytest.mark.slow
def test_prefix_cache_chunks_and_preemption_with_shared_kv() -> None:
    """KV-shared layers read their source's pages: a prefix-cache hit, 8-token prefill chunks and a
    pool too small for the batch (preemption) give the same tokens."""
    want = list(references("tiny-shared"))
    cached = engine("tiny-shared")
    long = CONVERSATIONS[1]
    assert cached.chat([long], GREEDY)[0].token_ids == want[1]
    hits = cached.pool.hits
    assert cached.chat([long], GREEDY)[0].token_ids == want[1]
    assert cached.pool.hits > hits  # the second run started from cached pages
    small = engine("tiny-shared", kv_cache_tokens=128, max_num_batched_tokens=8, page_size=8)
    assert [o.token_ids for o in small.chat(CONVERSATIONS, GREEDY)] == want
    assert small.scheduler.num_preemptions > 0
    uncached = engine("tiny-shared", enable_prefix_cache=False)
    assert uncached.chat([long], GREEDY)[0].token_ids == want[1]


def test_shared_layers_read_their_source_and_hold_no_pages() -> None:
    eng = engine("tiny-shared")
    model: Any = eng.model
    # layers 3, 4, 5 (sliding, sliding, full) read the last writing layer of their type: 1, 1, 2
    assert model.kv_sources == (0, 1, 2, 1, 1, 2)
    caches = eng.runner.kv_caches
    assert [caches[i] is caches[s] for i, s in enumerate(model.kv_sources)] == [True] * 6
    assert len({id(k) for k, _ in caches}) == 3
    # the global layer's own head dim and KV heads (k_eq_v: one global KV head of 32)
    assert [tuple(k.shape[2:]) for k, _ in caches] == [(2, 16), (2, 16), (1, 32)] * 2
    shared = model.model.layers[4]
    assert set(shared.self_attn.qkv_proj.shards) == {"q_proj"}
    assert shared.mlp.intermediate_size == 2 * model.model.layers[0].mlp.intermediate_size  # double-wide


def _pool_bytes_per_token(config: Any) -> tuple[int, int]:
    """(bytes of one token in the KV tensors a runner allocates for `config`'s model, the engine's
    own per-token sizing), bf16, from a runner with 2 pages of 16 tokens in each pool."""
    model = meta_model(config)
    pages, page_size = 2, 16
    runner = ModelRunner(
        model, torch.device("cpu"), torch.bfloat16, pages, page_size, create_backend("torch_sdpa", torch.device("cpu")),
        num_window_pages=pages,
    )  # fmt: skip
    distinct = {id(k): (k, v) for k, v in runner.kv_caches}.values()
    allocated = sum(k.nbytes + v.nbytes for k, v in distinct) // (pages * page_size)
    full, window = kv_token_bytes([model], torch.bfloat16)
    return allocated, full + window


def test_kv_bytes_per_token_of_an_e4b_shaped_model_with_and_without_sharing() -> None:
    """Gemma 4 E4B's text config (42 layers, 18 KV-shared) and the same without sharing."""
    shared = gemma4_text_config("gemma-4-E4B", max_position_embeddings=4096)
    unshared = gemma4_text_config("gemma-4-E4B", max_position_embeddings=4096, num_kv_shared_layers=0)
    with_sharing, sized_with = _pool_bytes_per_token(shared)
    without, sized_without = _pool_bytes_per_token(unshared)
    print(f"E4B-shaped KV bytes/token (bf16): {with_sharing} with sharing, {without} without")
    assert (sized_with, sized_without) == (with_sharing, without)
    # each writing layer: K and V of its KV heads x its head dim, 2 bytes
    layers = shared.layer_types

    def kv_bytes(config: Any, n: int) -> int:
        return sum(2 * 2 * config.num_key_value_heads * config.per_layer_config[i].head_dim for i in range(n))

    assert with_sharing == kv_bytes(shared, len(layers) - shared.num_kv_shared_layers)
    assert without == kv_bytes(unshared, len(layers))
    assert with_sharing < without


@pytest.mark.parametrize("name", sorted(GEMMA4_TEXT))
def test_the_released_text_configs_load_by_name_on_meta(name: str) -> None:
    """Every tensor of Transformers' Gemma4ForCausalLM for the released text config fills ours, none left."""
    from transformers import Gemma4ForCausalLM

    config = gemma4_text_config(name)
    model: Any = meta_model(config)
    with torch.device("meta"):
        hf = Gemma4ForCausalLM(config)
    tied = config.tie_word_embeddings
    checkpoint = [
        (n, torch.empty(t.shape, device="meta"))
        for n, t in hf.state_dict().items()
        if not (tied and n == "lm_head.weight")
    ]
    assert loader.load_weights(model, checkpoint) == []
    sources = model.kv_sources
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    assert sum(s != i for i, s in enumerate(sources)) == config.num_kv_shared_layers
    assert all(config.layer_types[s] == config.layer_types[i] and s < first_shared for i, s in enumerate(sources))
    assert {shape for shape in model.kv_shapes} == {
        (config.num_key_value_heads, 256),
        (config.num_key_value_heads, 512),
    }


@pytest.mark.slow
def test_fast_numerics_against_exact(ops: object) -> None:
    """bf16 fast (fused ops, prepacked linears) against bf16 exact on the shared-KV checkpoint."""
    path = str(cached_gemma4("tiny-shared"))
    fast = Engine(path, dtype="bfloat16", kv_cache_tokens=2048, numerics="fast")
    exact = Engine(path, dtype="bfloat16", kv_cache_tokens=2048, numerics="exact")
    assert fast.runner.fused_ops is not None
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    agreed = [
        greedy_agreement(f.token_ids, e.token_ids)
        for f, e in zip(fast.chat(CONVERSATIONS, params), exact.chat(CONVERSATIONS, params))
    ]
    print(f"fast vs exact (bf16): leading tokens agreed {agreed} of {MAX_TOKENS}")
    assert sum(agreed) >= len(CONVERSATIONS) * MAX_TOKENS // 2, agreed


def test_audio_parts_are_refused_by_name() -> None:
    """No audio tower is served: an audio part is a PromptError (the server's 400) that names it, for the
    VLM and the text model, never dropped silently; the text model refuses images as well."""
    from preprocess.errors import PromptError

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    text = {"type": "text", "text": "Hi"}
    vlm = Engine(str(cached_gemma4_vlm("tiny")), dtype="float32", kv_cache_tokens=1024, numerics="exact")
    for eng in (vlm, engine("tiny")):
        with pytest.raises(PromptError, match="input_audio"):
            eng.process_messages([{"role": "user", "content": [AUDIO_PART, text]}])
    with pytest.raises(PromptError, match="does not accept images"):
        engine("tiny").process_messages([{"role": "user", "content": [image, text]}])


@pytest.mark.slow
def test_a_tower_with_clipped_linears_and_standardized_outputs() -> None:
    """The released towers' stored buffers (clipping bounds, standardization) load as parameters and act
    as Transformers' do: one image and two odd images equal `generate`."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = cached_gemma4_vlm("tiny-clipped")
    hf = (
        AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval(),
        AutoProcessor.from_pretrained(str(path)),
    )
    eng = Engine(str(path), dtype="float32", kv_cache_tokens=2048, numerics="exact")
    tower: Any = eng.model.vision_tower
    assert {n.rpartition(".")[2] for n, _ in tower.named_parameters()} >= {"input_min", "output_max", "std_scale"}
    for conv in base_conversations()[1:3]:
        assert eng.chat([conv], GREEDY)[0].token_ids == hf_greedy(hf, conv, MAX_TOKENS)


@pytest.mark.parametrize("name", sorted(GEMMA4_AUDIO_RELEASES))
def test_the_released_e2b_e4b_load_without_their_audio_tower(name: str, caplog: pytest.LogCaptureFixture) -> None:
    """Transformers' full model (audio tower included) names the checkpoint: every tensor but the audio tower's
    and its embedder's fills one of our parameters, none left over; the audio ones are skipped unread (each
    a StoredTensor over no file, which any read refuses) and counted in one INFO line."""
    release = GEMMA4_AUDIO_RELEASES[name]
    config = release.config()
    model: Any = meta_model(config)
    checkpoint = released_checkpoint(release, config)
    audio = [(n, t) for n, t in checkpoint if n.startswith(AUDIO_CHECKPOINT_PREFIXES)]
    assert {n.split(".")[1] for n, _ in audio} == {"audio_tower", "embed_audio"}
    unreadable = {n: loader.StoredTensor(-1, 0, torch.bfloat16, tuple(t.shape)) for n, t in audio}
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        assert loader.load_weights(model, [(n, unreadable.get(n, t)) for n, t in checkpoint]) == []
    served = sum(t.numel() for n, t in checkpoint if n not in unreadable)
    assert sum(p.numel() for p in model.parameters()) == served  # tied: one embedding on both sides
    assert not [n for n, _ in model.named_parameters() if "audio" in n]
    assert f"{len(audio)} checkpoint tensors not served" in caplog.text
    assert "audio is not served" in caplog.text


def test_a_checkpoint_with_an_audio_tower_serves_text_and_images() -> None:
    """The tiny checkpoint with an audio tower: Transformers builds and loads it, ours skips it; greedy
    tokens equal `generate` on text and on an image, and an audio part is still a PromptError."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from preprocess.errors import PromptError

    path = str(cached_gemma4_vlm("tiny-audio"))
    hf_model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    assert hf_model.model.audio_tower is not None
    hf = (hf_model, AutoProcessor.from_pretrained(path))
    eng = Engine(path, dtype="float32", kv_cache_tokens=2048, numerics="exact")
    assert not [n for n, _ in eng.model.named_parameters() if "audio" in n]
    for conv in base_conversations()[:2]:
        assert eng.chat([conv], GREEDY)[0].token_ids == hf_greedy(hf, conv, MAX_TOKENS)
    with pytest.raises(PromptError, match="input_audio"):
        eng.process_messages([{"role": "user", "content": [AUDIO_PART, {"type": "text", "text": "Hi"}]}])


def test_the_benchmark_checkpoint_has_the_released_e4b_shapes() -> None:
    """benchmarks' gemma4-e4b row claims gemma-4-E4B-it's layers and tower: its preset must not drift from them."""
    from testkit.gemma4_checkpoints import GEMMA4_E4B_TEXT, GEMMA4_E4B_VISION
    from tests.released_configs import GEMMA4_VISION_SMALL

    for key, value in GEMMA4_TEXT["gemma-4-E4B"].items():
        assert GEMMA4_E4B_TEXT[key] == (list(value) if isinstance(value, (list, tuple)) else value), key
    assert GEMMA4_E4B_VISION == GEMMA4_VISION_SMALL


def test_the_benchmark_tokenizer_is_one_llama_cpp_converts(tmp_path: Any) -> None:
    """The SentencePiece-style BPE round-trips any text through its byte fallback, and the converter's reader
    (gguf's LlamaHfVocab, which refuses a byte-level BPE) takes it with every token."""
    import gguf

    from testkit.gemma4_checkpoints import GEMMA4_VLM_TOKENS, SPM_VOCAB_SIZE, _saved_vlm_tokenizer, _train_spm_bpe

    tokenizer = _saved_vlm_tokenizer(_train_spm_bpe(), tmp_path)
    tokenizer.save_pretrained(tmp_path)
    text = "Describe the photo.\n\nÜnïcödé ☃ and  two  spaces"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert "<0xE2>" in tokenizer.convert_ids_to_tokens(ids)  # ☃ is not in the trained pieces: bytes stand in
    assert len(tokenizer) == SPM_VOCAB_SIZE
    assert all(tokenizer.convert_tokens_to_ids(t) == i for i, t in enumerate(GEMMA4_VLM_TOKENS))
    assert len(list(gguf.LlamaHfVocab(tmp_path).all_tokens())) == SPM_VOCAB_SIZE


def test_the_bf16_tower_runs_our_attention_kernel_within_bf16_noise_of_sdpa() -> None:
    """The served VLM's tower (Transformers' module) in bf16 takes its attention from our flash kernel through
    Transformers' attention interface: on the processor's padded patches of two odd images its features stay
    within bf16 noise of the same tower on SDPA."""
    from PIL import Image
    from transformers import AutoProcessor

    from vlm_engine.models.vision_blocks import TRANSFORMERS_TOWER_ATTENTION, tower_flash_attention

    if tower_flash_attention(torch.zeros(1, dtype=torch.bfloat16)) is None:
        pytest.skip("no flash extension")
    path = cached_gemma4_vlm("tiny")
    tower = Engine(str(path), dtype="bfloat16", kv_cache_tokens=2048).runner.model.vision_tower
    assert tower.config._attn_implementation == TRANSFORMERS_TOWER_ATTENTION
    rng = torch.Generator().manual_seed(0)
    images = [
        Image.fromarray((torch.rand(h, w, 3, generator=rng) * 255).byte().numpy()) for h, w in ((61, 97), (130, 45))
    ]
    batch = AutoProcessor.from_pretrained(path).image_processor(images, return_tensors="pt")
    pixels, positions = batch["pixel_values"].to(torch.bfloat16), batch["image_position_ids"]
    assert bool((positions == -1).any())  # the padded patches the key mask hides
    with torch.inference_mode():
        ours = tower(pixel_values=pixels, pixel_position_ids=positions).last_hidden_state
        tower.config._attn_implementation = "sdpa"
        sdpa = tower(pixel_values=pixels, pixel_position_ids=positions).last_hidden_state
        tower.config._attn_implementation = TRANSFORMERS_TOWER_ATTENTION
    error = (ours.float() - sdpa.float()).norm() / sdpa.float().norm()  # the pooled real patches of both images
    print(f"tiny Gemma 4 tower, bf16: ours vs SDPA relative L2 {error:.2e}")
    assert not torch.equal(ours, sdpa) and error < 2e-2
