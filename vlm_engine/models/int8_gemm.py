"""Prefill-sized int8 / int4 products on the CPU's int8 dot products (csrc/int8_gemm.cpp), built on
first use like the other C++ ops.

`load_int8_gemm()` returns the extension module (`quant_gemm`, `impls`, `impl_name`) where the build
has an AVX2 + FMA + F16C path, else None: `QuantizedLinear` then keeps fused_ops' `quant_panel_linear`
at every row count. `quant_gemm` reads the same panels as that kernel and gives the same numbers bit
for bit; it is the faster one from `GEMM_MIN_ROWS` rows up. Built with AVX-512 BF16 (`wo_available()`) the
module also multiplies bf16 rows by int8 weights on vdpbf16ps (`wo_gemm`: the weights dequantized to
bf16 a strip at a time, x not rounded to int8), which `QuantizedLinear` runs from `WO_MIN_ROWS` rows.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

EXT_NAME = "vlm_engine_int8_gemm"
_SRC = Path(__file__).resolve().parent / "csrc" / "int8_gemm.cpp"


@functools.cache
def load_int8_gemm() -> ModuleType | None:
    from vlm_engine.kernels.build import build_extension, cpu_kernels_disabled

    if cpu_kernels_disabled():
        return None
    module = build_extension(EXT_NAME, _SRC)
    if module is None or not module.impls():
        logger.info("int8 GEMM unavailable in this build; quantized linears keep the decode kernel at every row count")
        return None
    return module
