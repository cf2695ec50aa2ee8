"""GGUF VLM test files made by llama.cpp's own tools from tiny random Hugging Face checkpoints, offline.

    gguf_vlm_dir("qwen2.5-vl", "Q4_K_M") -> a directory holding <model>-Q4_K_M.gguf and mmproj-<model>-f32.gguf
    source_checkpoint("qwen2.5-vl") -> the HF checkpoint those files were converted from

The text model goes through `convert_hf_to_gguf.py` (`--outtype f32 | f16 | bf16 | q8_0`), the vision tower
and projector through the same converter with `--mmproj`; the K-quants through `llama-quantize` from an f32
text file, as a user makes them. The llama.cpp tree: $VLM_ENGINE_LLAMACPP, else a llama-cpp-python sdist
unpacked under ~/llamacpp (PEERS.md), else the sdist fetched with `pip download` into the cache (the
converter and gguf-py are Python; `llama-quantize` is built from the same tree with CMake the first time
a K-quant is asked for). Files are cached under $VLM_ENGINE_CACHE (default ~/.cache/vlm_engine)/gguf-vlm.

Two assumptions of the converter that our locally built checkpoints break are widened in the converter's
process (`widen_converter`), as benchmarks/peers.py does for the benchmarks: our locally trained
tokenizer's pre-tokenizer hash is unknown to it (it splits with Qwen2's regex: declared `qwen2`), and the
mmproj name map is built for `block_count` blocks while the merger is named `mlp.{0,2}` (at least 3).

Run as a script, this module is that converter process: `python gguf_makers.py convert TREE -- ARGS...`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import runpy
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # its sdist vendors llama.cpp: converter, gguf-py, llama-quantize
CONVERTER_TYPES = ("F32", "F16", "BF16", "Q8_0")  # what convert_hf_to_gguf.py writes itself
QUANTIZE_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q4_K_S", "Q5_K_S")  # llama-quantize's, from the f32 file
MAKERS_VERSION = 1  # bump when the files made here change

QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def cache_root() -> Path:
    base = Path(os.environ.get("VLM_ENGINE_CACHE", Path.home() / ".cache" / "vlm_engine"))
    return base / "gguf-vlm"


# ---- the source checkpoints ----------------------------------------------------------------------


def source_checkpoint(family: str) -> Path:
    """The tiny random HF checkpoint a family's GGUF files are made from.

    qwen2.5-vl: the "tiny" preset with what the mmproj cannot say set as llama.cpp assumes it (112-px
    attention windows; the released processors' pixel budget) and a 256-wide text model, so that every
    decoder matrix has rows of whole 256-value K-quant super-blocks (narrower rows fall back to other types).
    qwen2-vl: the "tiny" checkpoint as the other tests use it (a 2-block tower); qwen3-vl: "tiny" with the released
    processor's pixel budget; smolvlm: "tiny" (SmolVLM2: a llama text file and an idefics3 mmproj; its
    processor's resize edge and 64-px tiles are what the mmproj stores and llama.cpp assumes); idefics3:
    "tiny-idefics3" (the same model with SmolVLM v1's Idefics3 classes); gemma3: "tiny" made to follow
    llama.cpp's assumptions, in the released checkpoints' tensor names (`_gemma3_source`).
    """
    from testkit import checkpoints, qwen_vl_checkpoints, smolvlm_checkpoints

    if family == "qwen2-vl":
        return checkpoints.cached_qwen2_vl("tiny")
    if family in ("smolvlm", "idefics3"):  # SmolVLM2; Idefics3's classes (SmolVLM v1), the same shapes
        return smolvlm_checkpoints.cached_smolvlm("tiny" if family == "smolvlm" else "tiny-idefics3")
    if family == "qwen3-vl":  # the "tiny" preset with the released processor's pixel budget
        preset = {**qwen_vl_checkpoints.QWEN3_VL_PRESETS["tiny"], "pixels": (65536, 16777216)}
        row = dataclasses.replace(qwen_vl_checkpoints.QWEN3_VL, cache_stem="qwen3-vl-gguf", presets={"gguf": preset})
        return checkpoints.cached_random_checkpoint(row, "gguf")
    if family == "gemma3":
        return _gemma3_source()
    if family != "qwen2.5-vl":
        raise ValueError(f"no GGUF test checkpoint for {family!r}")
    tiny = qwen_vl_checkpoints.QWEN2_5_VL_PRESETS["tiny"]
    preset = {
        **tiny,
        "text": {**tiny["text"], "hidden_size": 256, "intermediate_size": 512, "mrope_section": [8, 12, 12]},
        "vision": {**tiny["vision"], "window_size": 112},
        "pixels": (56 * 56, 28 * 28 * 16384),
    }
    row = dataclasses.replace(qwen_vl_checkpoints.QWEN2_5_VL, cache_stem="qwen2.5-vl-gguf", presets={"gguf": preset})
    return checkpoints.cached_random_checkpoint(row, "gguf")


def _gemma3_source() -> Path:
    """Gemma 3's "tiny" preset with what the text GGUF cannot say set as llama.cpp assumes it: a sliding
    window on 5 layers of 6 (layers 0-4 and 6 of 7: a sliding layer after a full one too), the query
    scaled by the head dim, the local RoPE base on the sliding layers, linear RoPE scaling on the full ones
    (which the file stores); a 256-wide text model, so that every decoder matrix has rows of whole 256-value
    K-quant super-blocks."""
    from testkit import checkpoints, gemma3_checkpoints

    tiny = gemma3_checkpoints.GEMMA3_PRESETS["tiny"]
    sliding, full = gemma3_checkpoints.SLIDING, gemma3_checkpoints.FULL
    text = {
        **tiny["text"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 7,
        "layer_types": [sliding] * 5 + [full, sliding],
    }  # fmt: skip
    preset = {**tiny, "text": {**text, "query_pre_attn_scalar": text["head_dim"]}}
    row = dataclasses.replace(gemma3_checkpoints.GEMMA3, cache_stem="gemma3-gguf-256", presets={"gguf": preset})
    return _released_gemma3_names(checkpoints.cached_random_checkpoint(row, "gguf"))


def _released_gemma3_names(saved: Path) -> Path:
    """`saved` with its tower under the released checkpoints' `vision_tower.vision_model.` (Transformers 5
    saves it as `vision_tower.`, a name gguf-py's map does not know): the files a user converts. The other
    files (config, tokenizer, templates: small) are copies of `saved`'s, not links, so the directory stays whole
    when `saved` is moved or a temporary cache holding it is deleted."""
    from safetensors.torch import load_file, save_file

    out = cache_root() / f"{saved.name}-released-names"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for item in saved.iterdir():
            if item.suffix != ".safetensors":
                shutil.copy2(item, staging / item.name)
        tensors = load_file(str(saved / "model.safetensors"))
        tower = "vision_tower."
        renamed = {
            (f"{tower}vision_model.{n[len(tower) :]}" if n.startswith(tower) else n): t for n, t in tensors.items()
        }
        save_file(renamed, str(staging / "model.safetensors"), {"format": "pt"})
        os.rename(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def gguf_vlm_dir(family: str, text_type: str = "F32", mmproj_type: str = "F32") -> Path:
    """A directory holding the family's text GGUF of `text_type` and its mmproj of `mmproj_type` (made once)."""
    hf_dir = source_checkpoint(family)
    stem = f"{hf_dir.name}-m{MAKERS_VERSION}"
    out = cache_root() / f"{stem}-{text_type}"
    if (out / ".complete").exists():
        return out
    text = _text_gguf(hf_dir, stem, text_type)
    mmproj = mmproj_gguf(family, mmproj_type)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=cache_root()))
    try:
        shutil.copy(text, staging / f"{stem}-{text_type}.gguf")
        shutil.copy(mmproj, staging / mmproj.name)
        (staging / ".complete").write_text("")
        shutil.rmtree(out, ignore_errors=True)
        os.rename(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def mmproj_gguf(family: str, mmproj_type: str = "F32") -> Path:
    """The family's vision tower and projector, as `convert_hf_to_gguf.py --mmproj` writes them."""
    hf_dir = source_checkpoint(family)
    out = cache_root() / f"mmproj-{hf_dir.name}-m{MAKERS_VERSION}-{mmproj_type}.gguf"
    return _made_once(out, _convert_command(hf_dir, mmproj_type, True))


def text_file(directory: Path) -> Path:
    (text,) = [p for p in directory.glob("*.gguf") if not p.name.startswith("mmproj-")]
    return text


def mmproj_file(directory: Path) -> Path:
    (mmproj,) = directory.glob("mmproj-*.gguf")
    return mmproj


def _text_gguf(hf_dir: Path, stem: str, text_type: str) -> Path:
    if text_type in CONVERTER_TYPES:
        return _made_once(cache_root() / f"{stem}-{text_type}.gguf", _convert_command(hf_dir, text_type, False))
    if text_type not in QUANTIZE_TYPES:
        raise ValueError(
            f"GGUF type {text_type!r}: the converter writes {CONVERTER_TYPES}, llama-quantize {QUANTIZE_TYPES}"
        )
    f32 = _text_gguf(hf_dir, stem, "F32")
    tool = str(llama_quantize())
    threads = str(os.cpu_count() or 2)
    return _made_once(
        cache_root() / f"{stem}-{text_type}.gguf", lambda tmp: [tool, str(f32), str(tmp), text_type, threads]
    )


def _made_once(out: Path, command: Any) -> Path:
    """`out`, made by `command(tmp)` unless it exists; renamed into place only once whole."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        done = subprocess.run(command(tmp), check=False, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{command(tmp)[:4]} failed:\n{done.stderr[-3000:]}")
        os.rename(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _convert_command(hf_dir: Path, outtype: str, mmproj: bool) -> Any:
    tree = llama_cpp_tree()
    args = [str(hf_dir), "--outtype", outtype.lower(), *(["--mmproj"] if mmproj else [])]
    return lambda tmp: [sys.executable, __file__, "convert", str(tree), "--", *args, "--outfile", str(tmp)]


# ---- the llama.cpp tree and its llama-quantize ---------------------------------------------------


def llama_cpp_tree() -> Path:
    """A llama.cpp source tree with convert_hf_to_gguf.py: $VLM_ENGINE_LLAMACPP, an unpacked sdist under
    ~/llamacpp, or one fetched into the cache."""
    candidates = [Path(p) for p in [os.environ.get("VLM_ENGINE_LLAMACPP", "")] if p]
    for base in (Path.home() / "llamacpp", cache_root() / "llamacpp"):
        candidates += sorted(base.glob("llama_cpp_python-*/vendor/llama.cpp"), reverse=True)
    for tree in candidates:
        if (tree / "convert_hf_to_gguf.py").exists():
            return tree
    return _fetch_tree(cache_root() / "llamacpp")


def _fetch_tree(base: Path) -> Path:
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base) as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", download,
             LLAMA_CPP_PYTHON],
            check=True,
        )  # fmt: skip
        (sdist,) = Path(download).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as archive:
            top = archive.getnames()[0].split("/")[0]
            if not (base / top).exists():
                archive.extractall(download, filter="data")
                os.rename(Path(download) / top, base / top)
    return base / top / "vendor" / "llama.cpp"


def llama_quantize() -> Path:
    """build/bin/llama-quantize of the tree, built (that target alone) when missing."""
    tree = llama_cpp_tree()
    for build in ("build", "build-quantize"):
        tool = tree / build / "bin" / "llama-quantize"
        if tool.exists():
            return tool
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=OFF"]  # fmt: skip
    subprocess.run(
        ["cmake", "-S", str(tree), "-B", str(tree / "build-quantize"), *flags], check=True, capture_output=True
    )
    jobs = str(os.cpu_count() or 2)
    subprocess.run(
        ["cmake", "--build", str(tree / "build-quantize"), "-j", jobs, "--target", "llama-quantize"],
        check=True, capture_output=True,
    )  # fmt: skip
    return tree / "build-quantize" / "bin" / "llama-quantize"


# ---- the converter's process --------------------------------------------------------------------


def widen_converter(tree: Path) -> None:
    sys.path[:0] = [str(tree), str(tree / "gguf-py")]
    import gguf  # type: ignore[import-not-found]
    from conversion import base  # type: ignore[import-not-found]

    original_pre, original_map = base.TextModel.get_vocab_base_pre, gguf.get_tensor_name_map

    def vocab_base_pre(self: Any, tokenizer: Any) -> str:
        try:
            return original_pre(self, tokenizer)
        except NotImplementedError:
            if uses_qwen2_split(Path(self.dir_model)):
                return "qwen2"
            raise

    def tensor_name_map(arch: Any, n_blocks: int) -> Any:
        return original_map(arch, max(n_blocks, 3) if arch == gguf.MODEL_ARCH.MMPROJ else n_blocks)

    base.TextModel.get_vocab_base_pre = vocab_base_pre
    gguf.get_tensor_name_map = tensor_name_map


def uses_qwen2_split(model_dir: Path) -> bool:
    """True when tokenizer.json pre-tokenizes with exactly Qwen2's split regex."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return False
    pre = json.loads(path.read_text()).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    return any(s.get("type") == "Split" and s.get("pattern", {}).get("Regex") == QWEN2_SPLIT_REGEX for s in steps)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] != "convert" or argv[2] != "--":
        raise SystemExit("usage: python testkit/gguf_makers.py convert LLAMA_CPP_TREE -- CONVERTER_ARGS...")
    tree = Path(argv[1]).resolve()
    widen_converter(tree)
    sys.argv = [str(tree / "convert_hf_to_gguf.py"), *argv[3:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
