"""AWQ and GPTQ packing as the tools write it, and their dequantization as two other implementations read it
(issue 51's tests of vlm_engine/models/quant_formats/awq.py and gptq.py).

The tools themselves run through `run_tool` (installed once into the cache, beside our venv, not in it: slow
tests). For the fast tests their packing loops are transcribed here, line for line in what they compute
(integer codes in, int32 words out; the float rounding before it is theirs to test), the slow tests check the
transcriptions against the tools, and each readback below comes from a different code base than the packer
it checks:

    autoawq_gemm_pack     AutoAWQ awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear (order_map loops)
    autoawq_gemv_pack     AutoAWQ awq/modules/linear/gemv.py, WQLinear_GEMV.from_linear, calculate_zeros_width
    gptqmodel_pack        GPTQModel gptqmodel/nn_modules/qlinear/__init__.py, PackableQuantLinear.pack_original
    gptqmodel_export_v1   GPTQModel gptqmodel/utils/model.py, convert_gptq_v2_to_v1_format_module (4 and 8 bits)
    autogptq_pack_v1      AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda.py, QuantLinear.pack (zeros -= 1)

    vllm_awq_dequantize       vLLM vllm/model_executor/layers/quantization/awq_triton.py, awq_dequantize_kernel
    awq_gemv_kernel_dequantize  AutoAWQ's GEMV CUDA kernel (gemv_cuda.cu, as GPTQModel ships it), per weight
    autogptq_dequantize       AutoGPTQ qlinear_cuda.py, QuantLinear.forward's torch path
    gptqmodel_dequantize      GPTQModel convert_gptq_v1_to_v2_format_module + PackableQuantLinear.dequantize_weight

Shapes follow the tools: AWQ GEMM and GPTQ take codes [in, out] (the transposed weight they pack), zeros
[groups, out]; the readbacks return fp32 weights [in, out].
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


# ---- packers -------------------------------------------------------------------------------------------------


def autoawq_gemm_pack(intweight: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [in, out], zeros [groups, out] -> qweight [in, out / 8], qzeros [groups, out / 8] (int32)."""
    pack_num = 8
    intweight, zeros = intweight.to(torch.int32), zeros.to(torch.int32)
    qweight = torch.zeros((intweight.shape[0], intweight.shape[1] // 32 * 4), dtype=torch.int32)
    for col in range(intweight.shape[1] // pack_num):
        for i in range(pack_num):
            qweight[:, col] |= intweight[:, col * pack_num + AWQ_ORDER_MAP[i]] << (i * 4)
    qzeros = torch.zeros((zeros.shape[0], zeros.shape[1] // 32 * 4), dtype=torch.int32)
    for col in range(zeros.shape[1] // pack_num):
        for i in range(pack_num):
            qzeros[:, col] |= zeros[:, col * pack_num + AWQ_ORDER_MAP[i]] << (i * 4)
    return qweight, qzeros


def awq_gemv_zeros_width(in_features: int, group_size: int = 128, pack_num: int = 8) -> int:
    if group_size >= 128:
        size_multiplier = 1
    elif group_size == 64:
        size_multiplier = 2
    elif group_size == 32:
        size_multiplier = 4
    else:
        raise NotImplementedError
    base_width = (in_features // group_size + pack_num - 1) // pack_num
    return (base_width + size_multiplier - 1) // size_multiplier * size_multiplier


def autoawq_gemv_pack(
    intweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [out, in], zeros and scales [out, groups] -> qweight [out, in / 8], qzeros [out, width],
    scales fp16 [out, width * 8] (zero-padded)."""
    pack_num, in_features = 8, intweight.shape[1]
    width = awq_gemv_zeros_width(in_features, group_size)
    qscales = torch.zeros((scales.shape[0], width * pack_num), dtype=torch.float16)
    qscales[:, : scales.shape[1]] = scales
    intweight, zeros = intweight.to(torch.int32), zeros.to(torch.int32)
    qweight = torch.zeros((intweight.shape[0], intweight.shape[1] // 32 * 4), dtype=torch.int32)
    for col in range(intweight.shape[1] // pack_num):
        for i in range(pack_num):
            qweight[:, col] |= intweight[:, col * pack_num + i] << (i * 4)
    qzeros = torch.zeros((zeros.shape[0], width), dtype=torch.int32)
    for col in range((zeros.shape[1] + pack_num - 1) // pack_num):
        for i in range(pack_num):
            if col * pack_num + i >= zeros.shape[1]:
                continue
            qzeros[:, col] |= zeros[:, col * pack_num + i] << (i * 4)
    return qweight, qzeros, qscales


def gptqmodel_pack(int_weight: torch.Tensor, zeros: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [in, out], zeros [groups, out] -> qweight [in * bits / 32, out], qzeros [groups, out * bits / 32]
    (int32), the zeros as they are (GPTQModel's internal v2)."""
    pack_factor = 32 // bits
    w = int_weight.numpy().astype(np.uint32)
    qweight = np.zeros((w.shape[0] * bits // 32, w.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(pack_factor):
            qweight[row] |= w[row * pack_factor + j] << (bits * j)
    z = zeros.numpy().astype(np.uint32)
    qzeros = np.zeros((z.shape[0], z.shape[1] * bits // 32), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(pack_factor):
            qzeros[:, col] |= z[:, col * pack_factor + j] << (bits * j)
    return torch.from_numpy(qweight.astype(np.int32)), torch.from_numpy(qzeros.astype(np.int32))


def gptqmodel_export_v1(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """The v2 -> v1 export: one subtracted from every field at once, as a whole-word int32 subtraction."""
    offset = {4: 0b00010001000100010001000100010001, 8: 0b00000001000000010000000100000001}[bits]
    qzeros = qzeros.clone()
    qzeros -= offset
    return qzeros


def autogptq_pack_v1(int_weight: torch.Tensor, zeros: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's export: qweight as GPTQModel's, each zero minus one before packing (no zero may be 0: its -1
    fills every higher field with ones)."""
    qweight, _ = gptqmodel_pack(int_weight, zeros, bits)
    z = (zeros.to(torch.int64) - 1).numpy().astype(np.uint32)
    qzeros = np.zeros((z.shape[0], z.shape[1] // 32 * bits), dtype=np.uint32)
    i, col = 0, 0
    while col < qzeros.shape[1]:
        for j in range(i, i + (32 // bits)):
            qzeros[:, col] |= z[:, j] << (bits * (j - i))
        i += 32 // bits
        col += 1
    return qweight, torch.from_numpy(qzeros.astype(np.int32))


# ---- readbacks from other implementations ----------------------------------------------------------------------


def vllm_awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """vLLM's Triton AWQ dequantization in torch: each word repeated 8 times (tl.interleave x3), shifted by
    4 * reverse_awq_order[column % 8], masked; (q - z) * s (here in fp32)."""
    reverse_awq_order = (torch.arange(2) * 4)[None, :] + torch.arange(4)[:, None]
    shifts = (reverse_awq_order.reshape(8) * 4).repeat(qweight.shape[1])
    group_size = qweight.shape[0] // scales.shape[0]
    iweights = (qweight.repeat_interleave(8, dim=1) >> shifts) & 0xF
    zeros = (qzeros.repeat_interleave(8, dim=1) >> shifts) & 0xF
    zeros = zeros.repeat_interleave(group_size, dim=0)
    return (iweights - zeros).float() * scales.float().repeat_interleave(group_size, dim=0)


def awq_gemv_kernel_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """gemv_cuda.cu per weight: (word >> 4 * (i % 8)) & 0xF of qweight[o, i // 8]; zero of group g at
    (qzeros[o, g // 8] >> 4 * (g % 8)) & 0xF; scaling_factor[o, g] * (w - z). Returns [in, out]."""
    i = torch.arange(qweight.shape[1] * 8)
    g = i // group_size
    w = (qweight[:, i // 8] >> (4 * (i % 8))) & 0xF
    z = (qzeros[:, g // 8] >> (4 * (g % 8))) & 0xF
    return (scales[:, g].float() * (w - z).float()).t()


def _fields(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """AutoGPTQ's / GPTQModel's `wf` unpack: words shifted by range(0, 32, bits) into a new axis after `dim`."""
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32)
    if dim == 1:  # qzeros: torch.unsqueeze(qzeros, 2).expand(-1, -1, pack) >> wf.unsqueeze(0)
        return torch.bitwise_right_shift(words.unsqueeze(2).expand(-1, -1, 32 // bits), wf.unsqueeze(0))
    # qweight: torch.unsqueeze(qweight, 1).expand(-1, pack, -1) >> wf.unsqueeze(-1)
    return torch.bitwise_right_shift(words.unsqueeze(1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1))


def autogptq_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int
) -> torch.Tensor:
    """AutoGPTQ's torch path: fields cast to int8 / int16, masked, zeros + 1 (unmasked), then
    scales[g_idx] * (weight - zeros[g_idx])."""
    small = torch.int16 if bits == 8 else torch.int8
    zeros = torch.bitwise_and(_fields(qzeros, bits, 1).to(small), (2**bits) - 1)
    zeros = (zeros + 1).reshape(scales.shape)
    weight = torch.bitwise_and(_fields(qweight, bits, 0).to(small), (2**bits) - 1)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    g = g_idx.long()
    return scales[g].float() * (weight - zeros[g]).float()


def gptqmodel_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int, v1: bool
) -> torch.Tensor:
    """GPTQModel's TorchQuantLinear (REQUIRES_FORMAT_V2): a v1 checkpoint's qzeros get the whole-word constant
    added back (int32, wrapping), then fields masked and scales[g_idx] * (weight - zeros[g_idx])."""
    if v1:
        qzeros = qzeros.clone()
        qzeros += {4: 0b00010001000100010001000100010001, 8: 0b00000001000000010000000100000001}[bits]
    zeros = torch.bitwise_and(_fields(qzeros, bits, 1), (2**bits) - 1).reshape(scales.shape)
    weight = torch.bitwise_and(_fields(qweight, bits, 0), (2**bits) - 1)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    g = g_idx.long()
    return scales[g].float() * (weight - zeros[g]).float()


# ---- the tools themselves ---------------------------------------------------------------------------------------
# AutoAWQ and GPTQModel cannot be installed in our venv (their pins), but their packing runs on our interpreter:
# each is `pip install --target`ed once into the cache with the few packages it needs that our venv lacks, and
# runs in a subprocess with PYTHONPATH pointing there (`run_tool`). AutoAWQ's package __init__ imports its model
# zoo (Transformers < 4.52); only its linear modules are loaded, under a stand-in package.

TOOL_PINS = {
    "autoawq": ("autoawq==0.2.9",),
    "gptqmodel": ("gptqmodel==7.7.0", "Defuser==0.0.28", "Device-SMI==0.5.7", "LogBar==0.4.15", "PyPcre==0.6.4",
                  "TokeNicer==0.0.14", "threadpoolctl==3.8.0"),
}  # fmt: skip


def tool_path(tool: str) -> Path:
    """The directory the tool is installed in (built once; a lock keeps parallel test workers from racing)."""
    from testkit.checkpoints import _file_lock, default_cache_root

    pins = TOOL_PINS[tool]
    target = default_cache_root().parent / "tools" / pins[0].replace("==", "-")
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if not target.exists():
            staging = target.with_name(target.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                 "--target", str(staging), *pins],
                check=True, env={**os.environ, "BUILD_CUDA_EXT": "0"},
            )  # fmt: skip
            staging.rename(target)
    return target


def run_tool(tool: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case packed (and read back) by the tool itself: see `_autoawq_cases` and `_gptqmodel_cases`."""
    with tempfile.TemporaryDirectory() as scratch:
        given, made = Path(scratch) / "cases.pt", Path(scratch) / "made.pt"
        torch.save(cases, given)
        path = os.pathsep.join([str(tool_path(tool)), str(Path(__file__).parents[1])])
        env = {**os.environ, "PYTHONPATH": path, "TMPDIR": scratch}  # what the tool leaves in tmp goes with scratch
        command = [sys.executable, "-m", "testkit.awq_gptq_packing", tool, str(given), str(made)]
        subprocess.run(command, check=True, env=env, cwd=scratch)  # GPTQModel writes a logs/ folder where it runs
        return torch.load(made)


def _autoawq_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Case: codes q [out, in], zeros z and fp16 scales s [out, groups], group_size. Packed by
    WQLinear_GEMM / WQLinear_GEMV.from_linear from the weight (q - z) * s, as AutoAWQ's quantizer calls them;
    read back by AutoAWQ's own CPU dequantization (dequantize_gemm, fp16 arithmetic, [in, out])."""
    import importlib.util
    import types

    from torch import nn

    found = importlib.util.find_spec("awq")
    sys.modules["awq"] = stand_in = types.ModuleType("awq")
    stand_in.__path__ = list(found.submodule_search_locations)
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.modules.linear.gemv import WQLinear_GEMV
    from awq.utils.packing_utils import dequantize_gemm

    made = []
    for case in cases:
        q, z, s, group_size = case["q"], case["z"], case["s"], case["group_size"]
        g = torch.arange(q.shape[1]) // group_size
        linear = nn.Linear(q.shape[1], q.shape[0], bias=False).half()
        linear.weight.data = ((q - z[:, g]).float() * s[:, g].float()).half()
        gemm = WQLinear_GEMM.from_linear(linear, 4, group_size, scales=s.t().contiguous(), zeros=z.t().contiguous())
        gemv = WQLinear_GEMV.from_linear(linear, 4, group_size, scales=s, zeros=z)
        made.append({
            "gemm": {"qweight": gemm.qweight, "qzeros": gemm.qzeros, "scales": gemm.scales},
            "gemm_dequantized": dequantize_gemm(gemm.qweight, gemm.qzeros, gemm.scales, 4, group_size),
            "gemv": {"qweight": gemv.qweight, "qzeros": gemv.qzeros, "scales": gemv.scales},
        })  # fmt: skip
    return made


def _gptqmodel_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Case: bits, sym, desc_act, group_size, codes q [out, in], zeros z and scales s [out, groups], g_idx [in].
    Packed by TorchLinear.pack_original from the weight s[g_idx] * (q - z[g_idx]) (GPTQModel's internal v2), then
    exported to v1 by convert_gptq_v2_to_v1_format_module; read back the way its loader does: v1 -> v2, then
    dequantize_weight ([in, out], fp16 scales)."""
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.quantization.config import QuantizeConfig
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module, convert_gptq_v2_to_v1_format_module
    from torch import nn

    made = []
    for case in cases:
        bits, sym, desc_act, group_size = case["bits"], case["sym"], case["desc_act"], case["group_size"]
        q, z, s, g_idx = case["q"], case["z"], case["s"], case["g_idx"]
        g = g_idx.long()
        linear = nn.Linear(q.shape[1], q.shape[0], bias=False)
        linear.weight.data = (q - z[:, g]).float() * s[:, g].float()
        packed = TorchLinear(
            bits=bits, group_size=group_size, sym=sym, desc_act=desc_act, in_features=q.shape[1],
            out_features=q.shape[0], bias=False, pack_dtype=torch.int32, register_buffers=True,
            enable_wf_unsqueeze=True,
        )  # fmt: skip
        packed.pack_original(linear, s.float(), z.float(), g_idx)
        v2 = {name: getattr(packed, name).clone() for name in ("qweight", "qzeros", "scales", "g_idx")}
        config = QuantizeConfig(bits=bits, group_size=group_size, sym=sym, desc_act=desc_act, offload_to_disk=False)
        convert_gptq_v2_to_v1_format_module(packed, config)
        v1 = {name: getattr(packed, name).clone() for name in ("qweight", "qzeros", "scales", "g_idx")}
        convert_gptq_v1_to_v2_format_module(packed, bits, torch.int32)
        packed.post_init()
        made.append({"gptq": v1, "gptq_v2": v2, "dequantized": packed.dequantize_weight()})
    return made


if __name__ == "__main__":
    tool_name, given_path, made_path = sys.argv[1:]
    run = {"autoawq": _autoawq_cases, "gptqmodel": _gptqmodel_cases}[tool_name]
    torch.save(run(torch.load(given_path)), made_path)
