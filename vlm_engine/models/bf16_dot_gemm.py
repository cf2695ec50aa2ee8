"""The bf16 linear on vdpbf16ps (csrc/bf16_dot_gemm.cpp), built on first use like the other C++ ops.

`load_bf16_dot_gemm()` returns the extension module (`pack_pairs`, `dot_linear`) where this CPU has
AVX-512 BF16 and the build has it too, else None: the prepacked linears then keep oneDNN's kernel.
Built for an AMX CPU the module also multiplies the same pairs on AMX tiles (`amx_linear`,
`amx_silu_mul`; `amx_available()` says whether this build and process may use them).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

from vlm_engine.kernels.cpu_isa import has_native_bf16

logger = logging.getLogger(__name__)

EXT_NAME = "vlm_engine_bf16_dot_gemm"
_SRC = Path(__file__).resolve().parent / "csrc" / "bf16_dot_gemm.cpp"


@functools.cache
def load_bf16_dot_gemm() -> ModuleType | None:
    from vlm_engine.kernels.build import build_extension, cpu_kernels_disabled

    if cpu_kernels_disabled() or not has_native_bf16():
        return None
    module = build_extension(EXT_NAME, _SRC)
    if module is None or not module.dot_linear_available():
        logger.info("bf16 dot-product linear unavailable in this build; bf16 linears stay on oneDNN")
        return None
    return module
