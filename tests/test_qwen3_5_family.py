"""What only the Qwen3.5 family does, layer by layer against Transformers' own modules in fp32: the gated
full-attention layer (output gate, unit-offset q/k norms, partial interleaved M-RoPE) over paged KV; the
Gated DeltaNet layer over one sequence, over two prefill chunks carrying its state through a state slot,
and decoding after a prefill; the whole text stack on a prompt; the vision tower without DeepStack; and
the state layout the engine allocates from (the end-to-end rows are in tests/family_table.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from testkit.videos import make_clip
from tests.conftest import hf_greedy, make_image
from tests.family_table import Family, exact_engine, family, hf_model, references
from tests.test_qwen_vl_families import FPS, GREEDY, hf_video_greedy, video_conv
from vlm_engine import Engine
from vlm_engine.attention.backends import create_backend
from vlm_engine.attention.base import AttentionMetadata
from vlm_engine.models import loader
from vlm_engine.models.families.qwen3_5.model import FULL, LINEAR, HybridDecoder, Qwen3_5ForConditionalGeneration
from vlm_engine.models.layers import ForwardContext, GatedMLP, StepState

PAGE = 16
ATOL = 2e-5  # the chunked gated delta rule sums in another order than Transformers' (fp32)


def text_config(layer_types: list[str]) -> Any:
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, layer_types=layer_types,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                         "mrope_interleaved": True, "partial_rotary_factor": 0.25},
    )  # fmt: skip
    config._attn_implementation = "eager"
    return config


def models(layer_types: list[str], seed: int = 0) -> tuple[Any, HybridDecoder, Any]:
    """Transformers' text model (random weights, norms too) and ours with its weights."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    config = text_config(layer_types)
    torch.manual_seed(seed)
    hf = Qwen3_5TextModel(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ours = HybridDecoder(config, lambda i: GatedMLP(config.hidden_size, config.intermediate_size), [2, 1, 1])
    assert loader.load_weights(ours, hf.state_dict().items()) == []
    return hf, ours.eval(), config


class Step:
    """One step's context over `lengths` new tokens of sequences that already hold `past` tokens, in
    state slots `slots`, with KV pages of their own (the engine's runner builds the same)."""

    def __init__(self, ours: HybridDecoder, pools: list[Any], kv: list[Any]) -> None:
        self.ours, self.pools, self.kv = ours, pools, kv

    def ctx(self, lengths: list[int], past: list[int], slots: list[int]) -> ForwardContext:
        pages_per_seq = 8
        starts = torch.tensor([0, *lengths]).cumsum(0)
        table = torch.tensor([[s * pages_per_seq + i for i in range(pages_per_seq)] for s in slots], dtype=torch.int32)
        mapping = torch.cat([
            table[j].long().repeat_interleave(PAGE)[p : p + n] * PAGE + torch.arange(p, p + n) % PAGE
            for j, (n, p) in enumerate(zip(lengths, past))
        ])  # fmt: skip
        meta = AttentionMetadata(
            query_start_loc=starts.to(torch.int32),
            seq_lens=torch.tensor([p + n for n, p in zip(lengths, past)], dtype=torch.int32),
            block_table=table,
            slot_mapping=mapping,
            query_lens_host=list(lengths),
            seq_lens_host=[p + n for n, p in zip(lengths, past)],
        )
        initial = [p > 0 for p in past]
        state = StepState(self.pools, torch.tensor(slots), torch.tensor(initial), list(slots), initial)
        return ForwardContext(meta, self.kv, create_backend("torch_sdpa", torch.device("cpu")), None, state=state)


def step_for(ours: HybridDecoder, config: Any, num_slots: int = 4) -> Step:
    pools: list[Any] = []
    kv: list[Any] = []
    for layer in ours.layers:
        if layer.layer_type == LINEAR:
            shapes = layer.linear_attn.state.shapes
            pools.append(tuple(torch.full((num_slots, *s), float("nan")) for s in shapes))  # cleared at token 0
            kv.append(None)
        else:
            pools.append(None)
            shape = (num_slots * 8, PAGE, config.num_key_value_heads, config.head_dim)
            kv.append((torch.zeros(shape), torch.zeros(shape)))
    return Step(ours, pools, kv)


def mrope_positions(n: int, start: int = 0) -> torch.Tensor:
    """[3, n]: the three axes apart (as inside an image), so the interleaving is exercised."""
    t = torch.arange(start, start + n)
    return torch.stack([t, t * 2 % 7 + start, t * 3 % 5 + start])


def hf_rotary(hf: Any, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return hf.rotary_emb(x[None], positions[:, None, :])


def causal_mask(n: int, past: int = 0) -> torch.Tensor:
    return torch.full((n, past + n), float("-inf")).triu(past + 1)[None, None]


@torch.inference_mode()
def test_gated_attention_layer_matches_transformers() -> None:
    hf, ours, config = models([FULL])
    step = step_for(ours, config)
    n = 21
    x = torch.randn(n, config.hidden_size)
    positions = mrope_positions(n)
    want, _ = hf.layers[0].self_attn(x[None], hf_rotary(hf, x, positions), causal_mask(n))
    cos, sin = ours.rotary.cos_sin(positions, x.dtype)
    assert cos.shape[-1] == config.head_dim // 4  # partial rotary: a quarter of the head
    got = ours.layers[0].self_attn(x, cos, sin, step.ctx([n], [0], [1]))
    torch.testing.assert_close(got, want[0], rtol=0, atol=1e-5)


@torch.inference_mode()
def test_gated_deltanet_one_sequence_matches_transformers() -> None:
    hf, ours, config = models([LINEAR])
    step = step_for(ours, config)
    for n in (1, 3, 70):  # shorter than the conv window, a chunk and a bit
        x = torch.randn(n, config.hidden_size)
        want = hf.layers[0].linear_attn(x[None])[0]
        ctx = step.ctx([n], [0], [2])
        got = ours.layers[0].linear_attn(x, ctx, _linear_step(ctx))
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def _linear_step(ctx: ForwardContext) -> Any:
    from vlm_engine.models.families.qwen3_5.model import clear_new_slots, linear_step

    clear_new_slots(ctx)
    return linear_step(ctx)


@torch.inference_mode()
def test_gated_deltanet_two_chunks_and_decode_carry_the_state() -> None:
    """Two prefill chunks through one slot = one prefill; then decode tokens = Transformers' cached
    decode (its recurrent rule); the slot holds Transformers' conv window and recurrent state."""
    from transformers import DynamicCache

    hf, ours, config = models([LINEAR])
    step = step_for(ours, config)
    layer = ours.layers[0].linear_attn
    x = torch.randn(40 + 3, config.hidden_size)
    cache = DynamicCache(config=config)
    want_prefill = hf.layers[0].linear_attn(x[None, :40], cache=cache)[0]
    want_decode = [hf.layers[0].linear_attn(x[None, i : i + 1], cache=cache)[0] for i in range(40, 43)]
    got = []
    for lengths, past in (([25], [0]), ([15], [25])):  # a cut that is no chunk boundary
        ctx = step.ctx(lengths, past, [3])
        got.append(layer(x[past[0] : past[0] + lengths[0]], ctx, _linear_step(ctx)))
    torch.testing.assert_close(torch.cat(got), want_prefill, rtol=0, atol=ATOL)
    for i, want in zip(range(40, 43), want_decode):
        ctx = step.ctx([1], [i], [3])
        torch.testing.assert_close(layer(x[i : i + 1], ctx, _linear_step(ctx)), want, rtol=0, atol=ATOL)
    conv, state = step.pools[0]
    hf_layer = cache.layers[0]
    torch.testing.assert_close(state[3], hf_layer.recurrent_states[0][0], rtol=0, atol=ATOL)
    # Transformers keeps the last kernel_size inputs [C, K]; the last K - 1 are the window we carry
    torch.testing.assert_close(conv[3], hf_layer.conv_states[0][0, :, 1:].t(), rtol=0, atol=0)


@torch.inference_mode()
def test_a_batch_mixing_prefill_and_decode_equals_each_alone() -> None:
    """Sequences of one step in their own slots: a decode token beside a prefill chunk and a fresh prompt."""
    _, ours, config = models([LINEAR, FULL, LINEAR])
    x = torch.randn(30, config.hidden_size)
    alone = step_for(ours, config)
    ctx = alone.ctx([12], [0], [0])
    ours(x[:12], torch.arange(12).expand(3, -1), ctx)
    ctx = alone.ctx([1], [12], [0])
    want_decode = ours(x[12:13], torch.tensor([12]).expand(3, -1), ctx)
    ctx = alone.ctx([9], [0], [1])
    want_fresh = ours(x[13:22], torch.arange(9).expand(3, -1), ctx)

    batched = step_for(ours, config)
    ctx = batched.ctx([12], [0], [0])
    ours(x[:12], torch.arange(12).expand(3, -1), ctx)
    ctx = batched.ctx([1, 9], [12, 0], [0, 1])
    positions = torch.cat([torch.tensor([12]), torch.arange(9)]).expand(3, -1)
    got = ours(torch.cat([x[12:13], x[13:22]]), positions, ctx)
    torch.testing.assert_close(got, torch.cat([want_decode, want_fresh]), rtol=0, atol=ATOL)


@torch.inference_mode()
def test_the_text_stack_matches_transformers_on_a_prompt() -> None:
    """Every layer kind, the unit-offset norms and the M-RoPE table: our decoder's last hidden states = Transformers'."""
    hf, ours, config = models([LINEAR, FULL, LINEAR, LINEAR, FULL])
    step = step_for(ours, config)
    n = 33
    ids = torch.randint(0, config.vocab_size, (n,))
    positions = mrope_positions(n)
    want = hf(input_ids=ids[None], position_ids=positions[:, None, :]).last_hidden_state[0]
    got = ours(ours.embed_tokens(ids), positions, step.ctx([n], [0], [0]))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_state_layout_declares_the_linear_layers_and_kv_the_rest() -> None:
    from transformers import Qwen3_5Config

    config = Qwen3_5Config(
        text_config=text_config([LINEAR, LINEAR, LINEAR, FULL]).to_dict(),
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64},
    )
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(config)
    layout = model.state_layout
    assert [entry is None for entry in layout] == [False, False, False, True]
    conv_dim = 2 * 2 * 16 + 4 * 16
    assert layout[0].shapes == ((3, conv_dim), (4, 16, 16)) and layout[0].dtypes == (None, torch.float32)
    assert layout[0].bytes(torch.float32) == (3 * conv_dim + 4 * 16 * 16) * 4
    assert model.kv_layout == (4, 2, 32)
    assert model.visual.deepstack_visual_indexes == [] and model.position_axes == 3


def test_the_vision_tower_matches_transformers() -> None:
    """Qwen3-VL's tower, reused: without DeepStack it is Qwen3.5's, bit for bit in fp32."""
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    from vlm_engine.models.qwen3_vision import Qwen3VisionTower

    cfg = Qwen3_5VisionConfig(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=96,
                              num_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    hf = Qwen3_5VisionModel._from_config(cfg, attn_implementation="sdpa").eval()
    ours = Qwen3VisionTower(cfg)
    assert loader.load_weights(ours, hf.state_dict().items()) == []
    grid = torch.tensor([[1, 4, 6], [2, 2, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 16 * 16)
    with torch.inference_mode():
        want = hf(pixels, grid_thw=grid).pooler_output
        merged, deepstack = ours(pixels, grid)
    assert deepstack == []
    torch.testing.assert_close(merged, want, rtol=0, atol=0)


@pytest.mark.parametrize("layer_types", [[LINEAR], [FULL]])
def test_a_model_without_state_needs_no_state(layer_types: list[str]) -> None:
    """All-full-attention stacks run without a state pool; a linear layer without one is a clear error."""
    _, ours, config = models(layer_types)
    step = step_for(ours, config)
    ctx = step.ctx([5], [0], [0])
    ctx.state = None
    x = torch.randn(5, config.hidden_size)
    if layer_types == [FULL]:
        assert ours(x, torch.arange(5).expand(3, -1), ctx).shape == x.shape
    else:
        with pytest.raises(RuntimeError, match="state slots"):
            ours(x, torch.arange(5).expand(3, -1), ctx)


# ---- end to end, on the family matrix's tiny checkpoints (greedy tokens = Transformers' generate) ------


@pytest.fixture(scope="module", params=["qwen3.5", "qwen3.5-moe"])
def row(request: pytest.FixtureRequest) -> Family:
    return family(request.param)


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_clip(width=97, height=75, fps=7, seconds=3, pix_fmt="yuv444p", picture=make_image(200, 150, 8))


def test_video_and_image_with_video_match_hf(row: Family, clip: bytes) -> None:
    engine, image = exact_engine(row), make_image(61, 45, 9)
    video = engine.chat([video_conv(clip)], GREEDY, mm_processor_kwargs={"fps": FPS})[0]
    assert video.token_ids == hf_video_greedy(hf_model(row), clip)
    both = engine.chat([video_conv(clip, image)], GREEDY, mm_processor_kwargs={"fps": FPS})[0]
    assert both.token_ids == hf_video_greedy(hf_model(row), clip, image)


def test_24_token_chunks_cutting_through_images_equal_one_prefill(row: Family) -> None:
    engine = Engine(str(row.path), dtype="float32", numerics="exact", kv_cache_tokens=4096, max_num_batched_tokens=24)
    assert [o.token_ids for o in engine.chat(row.conversations, row.greedy)] == list(references(row))


def test_a_prefix_hit_mid_conversation_restores_a_state_snapshot(row: Family) -> None:
    """The next turn of a conversation reuses the cached pages of the turns before it: the linear layers
    resume from the snapshot at the hit's end, and the answer is still Transformers'."""
    engine = Engine(str(row.path), dtype="float32", numerics="exact", kv_cache_tokens=4096)
    conv = row.conversations[3]
    first = engine.chat([conv], row.greedy)[0]
    follow_up = [*conv, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And the shapes?"}]
    hits = engine.scheduler.states.snapshot_hits
    out = engine.chat([follow_up], row.greedy)[0]
    assert out.cached_tokens > 0 and engine.scheduler.states.snapshot_hits > hits
    assert out.token_ids == hf_greedy(hf_model(row), follow_up, row.max_tokens)


def test_ngram_speculation_equals_plain_greedy(row: Family) -> None:
    spec = Engine(
        str(row.path), dtype="float32", kv_cache_tokens=4096, numerics="exact",
        speculative="ngram", speculative_disable_batch_size=1000,
    )  # fmt: skip
    assert [o.token_ids for o in spec.chat(row.conversations[:4], row.greedy)] == list(references(row)[:4])


# ---- Qwen3-Next (text only): the same stack with 1-D RoPE and grouped projections -------------------------

QWEN3_NEXT_CONVERSATIONS = [
    [{"role": "user", "content": "Tell me a story about a red fox."}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name three colors."},
        {"role": "assistant", "content": "Red, green, blue."},
        {"role": "user", "content": "Two more?"},
    ],
]


def hf_text_greedy(path: Any, conversations: list[Any], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    out = []
    for conv in conversations:
        ids = tokenizer.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            tokens = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(tokens[0, ids["input_ids"].shape[1] :].tolist())
    return out


def test_qwen3_next_greedy_matches_hf_alone_batched_and_in_chunks() -> None:
    from testkit.qwen3_5_checkpoints import cached_qwen3_next

    path, greedy = cached_qwen3_next("tiny"), family("qwen3.5").greedy
    want = hf_text_greedy(path, QWEN3_NEXT_CONVERSATIONS, greedy.max_tokens)
    engine = Engine(str(path), dtype="float32", numerics="exact", kv_cache_tokens=2048)
    assert engine.model.position_axes == 1
    assert [engine.chat([c], greedy)[0].token_ids for c in QWEN3_NEXT_CONVERSATIONS] == want
    assert [o.token_ids for o in engine.chat(QWEN3_NEXT_CONVERSATIONS, greedy)] == want
    chunked = Engine(str(path), dtype="float32", numerics="exact", kv_cache_tokens=2048, max_num_batched_tokens=24)
    assert [o.token_ids for o in chunked.chat(QWEN3_NEXT_CONVERSATIONS, greedy)] == want


def test_qwen3_next_80b_names_load() -> None:
    """Qwen3-Next-80B-A3B-Instruct's config values (four of its 48 layers: the names repeat), its tensors named as
    Transformers saves them (experts one by one, in_proj_qkvz / in_proj_ba): every one loads, none left over."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from vlm_engine.models.families.qwen3_5.model import Qwen3NextForCausalLM as Ours

    config = Qwen3NextConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=262144,
        rms_norm_eps=1e-6, tie_word_embeddings=False, full_attention_interval=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        architectures=["Qwen3NextForCausalLM"],
    )  # fmt: skip
    with torch.device("meta"):
        hf, ours = Qwen3NextForCausalLM(config), Ours(config)
    saved = revert_weight_conversion(hf, hf.state_dict())
    assert (
        "model.layers.0.linear_attn.in_proj_qkvz.weight" in saved
        and "model.layers.0.mlp.experts.511.up_proj.weight" in saved
    )
    assert loader.load_weights(ours, [(n, torch.empty(t.shape, device="meta")) for n, t in saved.items()]) == []
    assert sum(p.numel() for p in ours.parameters()) == sum(t.numel() for t in saved.values())
    assert [entry is None for entry in ours.state_layout] == [False, False, False, True]
