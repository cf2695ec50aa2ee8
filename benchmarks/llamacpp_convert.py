"""Run llama.cpp's `convert_hf_to_gguf.py` on our locally built test checkpoints.

    python benchmarks/llamacpp_convert.py LLAMA_CPP_TREE -- CONVERTER_ARGS...

The converter itself is run unchanged (it comes from the llama.cpp tree the benchmark built,
PEERS.md); two of its assumptions do not hold for checkpoints made by
`testkit.checkpoints`, so they are widened in this process before it starts:

- it identifies a BPE pre-tokenizer by hashing how a known text tokenizes and refuses unknown
  hashes. Our Qwen2-VL tokenizer is trained locally (so its hash is new) but splits words with
  Qwen2's own regex: such a tokenizer is declared `qwen2`, which is what llama.cpp then uses.
- the mmproj tensor-name map is built for `block_count` vision blocks, yet Qwen2-VL's projector
  is named `visual.merger.mlp.{0,2}` by block index: a 2-block test tower has no name for
  `mlp.2`. The map is built for at least 3 blocks (names only; no tensor is invented).

Qwen2.5-VL (`testkit.qwen_vl_checkpoints`, "tiny" and "bench-3b") converts with these two alone,
text (`--outtype bf16`) and `--mmproj` (checked with llama-cpp-python 0.3.36's tree). Two things to know: the
tree's Qwen2-VL/2.5-VL class tries `sentencepiece` before the BPE vocabulary and fails on the import if it is
missing (the bench extra installs it); and the mmproj file has no window-size key, so llama.cpp's vision tower
uses 112-px windows, which the tiny preset's 56-px windows are not (bench-3b's are: the real model's 112).
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def uses_qwen2_split(model_dir: Path) -> bool:
    """True when tokenizer.json pre-tokenizes with exactly Qwen2's split regex."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return False
    pre = json.loads(path.read_text()).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    return any(s.get("type") == "Split" and s.get("pattern", {}).get("Regex") == QWEN2_SPLIT_REGEX for s in steps)


def widen_converter(tree: Path) -> None:
    sys.path[:0] = [str(tree), str(tree / "gguf-py")]
    import gguf  # type: ignore[import-not-found]
    from conversion import base  # type: ignore[import-not-found]

    original_pre = base.TextModel.get_vocab_base_pre

    def vocab_base_pre(self: Any, tokenizer: Any) -> str:
        try:
            return original_pre(self, tokenizer)
        except NotImplementedError:
            if uses_qwen2_split(Path(self.dir_model)):
                return "qwen2"
            raise

    base.TextModel.get_vocab_base_pre = vocab_base_pre

    original_map = gguf.get_tensor_name_map

    def tensor_name_map(arch: Any, n_blocks: int) -> Any:
        if arch == gguf.MODEL_ARCH.MMPROJ:
            n_blocks = max(n_blocks, 3)
        return original_map(arch, n_blocks)

    gguf.get_tensor_name_map = tensor_name_map


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        raise SystemExit(__doc__)
    tree = Path(sys.argv[1]).resolve()
    widen_converter(tree)
    script = tree / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *sys.argv[3:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
