"""Fused element-wise ops for the CPU decoder, bf16 and fp32 (C++, built on first use like the attention op).

`load_fused_ops()` returns the extension module with `rms_norm`, `add_rms_norm_`, `rotary_`,
`silu_and_mul` and `argmax_rows` (see csrc/fused_ops.cpp), or None where it cannot be built or
does not apply.
The torch code in `vlm_engine.models.layers` stays the reference and the "exact" numerics path,
which must match Transformers token for token; these ops run only in "fast" numerics.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

EXT_NAME = "vlm_engine_fused_ops"
_SRC = Path(__file__).resolve().parent / "csrc" / "fused_ops.cpp"


def fused_ops_apply(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)


@functools.cache
def load_fused_ops() -> ModuleType | None:
    from vlm_engine.kernels.build import build_extension, cpu_kernels_disabled

    if cpu_kernels_disabled():
        logger.info("fused CPU ops disabled by VLM_ENGINE_DISABLE_CPU_KERNEL")
        return None

    return build_extension(EXT_NAME, _SRC)
