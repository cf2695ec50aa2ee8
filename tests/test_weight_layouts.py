"""A packed linear's weight held once (`weight_layouts="one"`, the default) or in two layouts, and a
loader that reads each checkpoint tensor straight into its parameter and packs each linear as soon
as it is filled, so that a model's plain and packed weights never both exist."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from vlm_engine import Engine, SamplingParams
from vlm_engine.kernels.cpu_isa import has_native_bf16
from vlm_engine.models import loader
from vlm_engine.models.bf16_dot_gemm import load_bf16_dot_gemm
from vlm_engine.models.layers import GatedMLP
from vlm_engine.models.prepack import ALL_ROWS, PackedLinear, prepack_linears, prepack_supported

BF16 = torch.bfloat16
dot = load_bf16_dot_gemm()
needs_dot = pytest.mark.skipif(dot is None, reason="no bf16 dot-product kernel on this CPU or build")
needs_bf16_packing = pytest.mark.skipif(
    not prepack_supported(torch.device("cpu"), BF16), reason="oneDNN cannot pack bf16 weights on this CPU"
)


def decoder_block(seed: int) -> nn.Module:
    """A GatedMLP (its gate/up projection packs for silu(gate) * up) beside two plain linears, one
    with a bias, in bf16 with weights of unit scale."""
    gen = torch.Generator().manual_seed(seed)
    block = nn.ModuleDict(
        {"mlp": GatedMLP(96, 64), "qkv": nn.Linear(96, 160), "o": nn.Linear(96, 96, bias=False)}
    ).requires_grad_(False)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / 96**0.5)
    return block.to(BF16)


def weight_bytes(model: nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))


def held_bytes(model: nn.Module) -> int:
    return sum(m.held_bytes() for m in model.modules() if isinstance(m, PackedLinear))


@needs_bf16_packing
@pytest.mark.parametrize("kernels", ["dot", "panels"])
def test_one_layout_holds_the_weight_once_and_two_twice(kernels: str, ops: object) -> None:
    if kernels == "dot" and dot is None:
        pytest.skip("no bf16 dot-product kernel on this CPU or build")
    args = (None, False, dot) if kernels == "dot" else (ops, False, None)
    one, two = decoder_block(0), decoder_block(0)
    plain = weight_bytes(one)
    prepack_linears(one, *args, layouts="one")
    prepack_linears(two, *args, layouts="two")
    # Padding to 16-column panels and even inputs, and the fp32 copy of the bias, on top.
    assert plain <= held_bytes(one) <= 1.1 * plain
    assert held_bytes(two) >= 1.9 * plain
    assert all(m.weight.stride() == (0, 0) for m in one.modules() if isinstance(m, PackedLinear))  # no oneDNN copy


@needs_dot
@pytest.mark.parametrize("rows", [1, 9, 257, 600])
def test_one_layout_runs_the_decode_kernels_at_every_row_count(rows: int) -> None:
    """Each product is the one the two-layout linear gives where it takes the pairs (the decode sizes):
    the dot kernel's or, on an AMX CPU above its rows, the AMX tiles' bits; a plain call of the gate/up
    projection is its pairs' product with the columns back in order."""
    from vlm_engine.models.fused_ops import load_fused_ops

    fused = load_fused_ops()
    one, reference = decoder_block(1), decoder_block(1)
    prepack_linears(one, None, False, dot, layouts="one")
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(BF16)
    qkv = one["qkv"]
    assert qkv.dot_max_rows == ALL_ROWS or qkv.amx_max_rows == ALL_ROWS
    tiles = rows > qkv.dot_max_rows
    product = dot.amx_linear if tiles else dot.dot_linear
    pairs = dot.pack_pairs(reference["qkv"].weight.contiguous())
    assert torch.equal(qkv(x), product(x, pairs, 160, reference["qkv"].bias.float()))
    gate_up = one["mlp"].gate_up_proj
    assert gate_up._gate_up_pairs is not None and gate_up._pairs is None
    plain_pairs = dot.pack_pairs(reference["mlp"].gate_up_proj.weight.contiguous())
    assert torch.equal(gate_up(x), product(x, plain_pairs, 128))
    gated = (dot.amx_silu_mul if tiles else dot.dot_silu_mul)(x, gate_up._gate_up_pairs, 64)
    assert torch.equal(gate_up.silu_and_mul(x, fused), gated)
    torch.testing.assert_close(one["mlp"](x, fused).float(), reference["mlp"](x, fused).float(), rtol=2**-7, atol=2e-2)


def test_fp32_linears_hold_one_layout_either_way(ops: object) -> None:
    one = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 16)).requires_grad_(False)
    two = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 16)).requires_grad_(False)
    two.load_state_dict(one.state_dict())
    plain = weight_bytes(one)
    prepack_linears(one, ops, layouts="one")
    prepack_linears(two, ops, layouts="two")
    assert held_bytes(one) == held_bytes(two) <= 1.1 * plain
    x = torch.randn(5, 64)
    assert torch.equal(one(x), two(x))


def test_unknown_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="layouts"):
        PackedLinear(nn.Linear(8, 8), layouts="three")
    with pytest.raises(ValueError, match="weight_layouts"):
        Engine("SmolLM2-135M-Instruct", weight_layouts="three")


# ---- the loader ------------------------------------------------------------------------------------


def test_stored_tensors_read_what_safetensors_reads(tiny_vlm_dir: Path) -> None:
    from safetensors import safe_open

    (path,) = sorted(tiny_vlm_dir.glob("*.safetensors"))
    with safe_open(str(path), framework="pt") as f:
        want = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (a safe_open handle, no dict)
    got = {}
    for name, stored in loader.iter_safetensors(tiny_vlm_dir):
        assert isinstance(stored, loader.StoredTensor)
        got[name] = stored.read()
        into = torch.empty(stored.shape, dtype=stored.dtype)
        stored.read_into(into)
        assert torch.equal(into, got[name])
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)


def test_each_linear_is_handed_over_once_filled_and_then_freed() -> None:
    """on_filled(path) comes right after a linear's last tensor (every shard of a fused one), and
    load_weights then holds nothing of it: replaced, its plain weight is freed at once."""
    model = nn.ModuleDict({"mlp": GatedMLP(16, 8), "o": nn.Linear(16, 16)}).requires_grad_(False)
    checkpoint = [
        ("mlp.gate_proj.weight", torch.randn(8, 16)),
        ("o.weight", torch.randn(16, 16)),
        ("mlp.up_proj.weight", torch.randn(8, 16)),
        ("o.bias", torch.randn(16)),
        ("mlp.down_proj.weight", torch.randn(16, 8)),
    ]
    events: list[str] = []
    freed: list[weakref.ref] = []

    def on_filled(path: str) -> None:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        freed.append(weakref.ref(getattr(parent, name).weight))
        setattr(parent, name, nn.Identity())
        gc.collect()
        events.append(path)

    def tensors():
        for name, tensor in checkpoint:
            events.append(name)
            yield name, tensor

    assert loader.load_weights(model, tensors(), on_filled=on_filled) == []
    assert events == [
        "mlp.gate_proj.weight", "o.weight", "mlp.up_proj.weight", "mlp.gate_up_proj",
        "o.bias", "o", "mlp.down_proj.weight", "mlp.down_proj",
    ]  # fmt: skip
    assert [ref() for ref in freed] == [None, None, None]


@needs_bf16_packing
def test_load_time_packing_equals_packing_after_the_load(tiny_vlm_dir: Path) -> None:
    """The engine's path (LoadTimePacker while loading) packs the same linears the same way as
    prepack_linears over a loaded model: same layers, bytes and outputs."""
    from vlm_engine.models.build import build_model
    from vlm_engine.models.registry import load_config, resolve_model

    source = resolve_model(str(tiny_vlm_dir))
    config = load_config(source)
    streamed = build_model(source, config, BF16, torch.device("cpu"), prepack=True)
    after = build_model(source, config, BF16, torch.device("cpu"), prepack=False)
    dot_ops = load_bf16_dot_gemm()
    for name in getattr(after, "encoder_modules", ()):
        prepack_linears(after.get_submodule(name))
    prepack_linears(after, None, False, dot_ops)
    packed = {n: m for n, m in streamed.named_modules() if isinstance(m, PackedLinear)}
    reference = {n: m for n, m in after.named_modules() if isinstance(m, PackedLinear)}
    assert packed.keys() == reference.keys() and packed
    assert [repr(m) for m in packed.values()] == [repr(m) for m in reference.values()]
    gen = torch.Generator().manual_seed(0)
    for name, module in packed.items():
        x = torch.randn(7, module.in_features, generator=gen).to(module.dtype)
        assert torch.equal(module(x), reference[name](x)), name
    assert held_bytes(streamed) == held_bytes(after)


@pytest.mark.skipif(not has_native_bf16(), reason="bf16 engines run fp32 on this CPU")
def test_engines_in_either_layout_give_the_same_tokens(tiny_vlm_dir: Path) -> None:
    """At these prompt sizes both modes run the decode kernels for every product: the same tokens,
    with half the bytes held in one layout."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[{"role": "user", "content": "Describe a lighthouse at dusk."}], [{"role": "user", "content": "Hi"}]]
    tokens, held = {}, {}
    for layouts in ("one", "two"):
        engine = Engine(str(tiny_vlm_dir), dtype="bfloat16", kv_cache_tokens=1024, weight_layouts=layouts)
        tokens[layouts] = [out.token_ids for out in engine.chat(prompts, params)]
        held[layouts] = held_bytes(engine.model.model)  # the decoder's linears
        del engine
    assert tokens["one"] == tokens["two"]
    assert held["two"] >= 1.8 * held["one"]
