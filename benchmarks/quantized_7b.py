"""Issue 51's benchmark files: the Qwen2.5-VL-7B-shaped bench checkpoint (`models.MODELS["qwen2.5-vl-7b"]`, random
bf16 weights) quantized three ways, each by the tool a user would run, made once and cached beside the checkpoints:

    awq    AWQ GEMM, 4 bits, group 128, zero point: Qwen2.5-VL-7B-Instruct-AWQ's layout (decoder linears packed,
           vision tower, embeddings and lm_head float16, `modules_to_not_convert: ["visual"]`). AutoAWQ 0.2.9's own
           code, linear by linear: AwqQuantizer.pseudo_quantize_tensor (its round-to-nearest min-max, fp16) and
           WQLinear_GEMM.from_linear (its packing), as its `_apply_quant` calls them; each packed linear is read back
           by AutoAWQ's dequantize_gemm and must equal the weight it packed.
    w8a8   compressed-tensors W8A8 (int8 weights per output channel, dynamic per-token int8 activations; text
           linears only): llm-compressor 0.14's `model_free_ptq`, its own safetensors-in, safetensors-out path
           (one shard at a time, a static min-max observer per weight, the library's compressor).
    gguf   llama.cpp: the converter on the bf16 checkpoint (BF16 text + BF16 mmproj), `llama-quantize Q4_K_M`; the
           15 GB BF16 text file is deleted once the Q4_K_M file exists (peers.LlamaCpp.quantized).

No calibration: AWQ's activation-aware scale search and GPTQ-style error feedback need real activations, which a
random model does not have, and a 7B calibration on 2 cores would take hours for numbers no benchmark reads. So the
AWQ and W8A8 codes are the tools' round-to-nearest ones; the bytes, shapes, dtypes and configs are the formats'.

Every step streams: one tensor (AWQ) or one shard (W8A8) in memory at a time, under ~3 GiB.

    .venv/bin/python benchmarks/quantized_7b.py [awq] [w8a8] [gguf]    # all three by default; cached ones skipped

Each checkpoint keeps `quant_maker.json` (tool versions, CPU and wall seconds, what was done); the script prints
every file's size and the seconds each step took.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BASE = "qwen2.5-vl-7b"  # models.MODELS alias of the bf16 checkpoint
MAKER_VERSION = 1  # bump when the bytes written change
AWQ_BITS, AWQ_GROUP = 4, 128
# Qwen/Qwen2.5-VL-7B-Instruct-AWQ's config.json: the vision tower is named; lm_head is no linear AWQ packs.
AWQ_CONFIG = {"quant_method": "awq", "bits": AWQ_BITS, "group_size": AWQ_GROUP, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": ["visual"]}  # fmt: skip
W8A8_IGNORE = ["lm_head", "re:.*visual.*"]  # the published VLM recipes': head and tower stay in floating point
# model_free_ptq matches weights by name only ("Linear" targets every 2-D `*.weight` not under a `*norm`), so the
# embedding table must be named too; a module-based oneshot would skip it as no Linear, and the config says so.
W8A8_NAME_ONLY_IGNORE = ["re:.*embed_tokens$"]
GGUF_TYPE = "Q4_K_M"


# ---- the three formats -----------------------------------------------------------------------------------------


def awq_checkpoint(base: Path) -> Path:
    from testkit.awq_gptq_packing import TOOL_PINS, tool_path
    from testkit.checkpoints import cached_checkpoint

    version = TOOL_PINS["autoawq"][0].split("==")[1]
    name = f"{base.name}-awq-gemm-g{AWQ_GROUP}-rtn-autoawq{version}-m{MAKER_VERSION}"
    # The tool's modules on PYTHONPATH, our interpreter (AutoAWQ cannot be installed beside our pins).
    path = os.pathsep.join([str(tool_path("autoawq")), str(Path(__file__).resolve().parents[1])])
    command = [sys.executable, __file__, "_awq", str(base)]

    def make(tmp: Path) -> None:
        _built(base)
        _made_by(command, tmp, {"PYTHONPATH": path}, {"autoawq": version})

    return cached_checkpoint(name, make)


def w8a8_checkpoint(base: Path) -> Path:
    from testkit.checkpoints import cached_checkpoint
    from testkit.quant_makers import TOOLS, quant_venv

    tool = TOOLS["llmcompressor"]
    name = f"{base.name}-w8a8-rtn-llmcompressor{tool.version}-m{MAKER_VERSION}"
    command = [str(quant_venv("llmcompressor") / "bin" / "python"), __file__, "_w8a8", str(base)]

    def make(tmp: Path) -> None:
        _built(base)
        _made_by(command, tmp, {}, {})

    return cached_checkpoint(name, make)


CHECKPOINTS: dict[str, Callable[[Path], Path]] = {"awq": awq_checkpoint, "w8a8": w8a8_checkpoint}


def gguf_pair(base: Path, llama: Any) -> tuple[Path, Path]:
    """(the Q4_K_M text GGUF, the BF16 mmproj) of `base`, from llama.cpp's converter and quantizer (`peers.LlamaCpp`)."""
    import models
    import peers

    row = models.MODELS[BASE]
    wanted = (peers.GGUF_CACHE / f"{base.name}-{GGUF_TYPE}.gguf", peers.converted_path(base, row.mmproj_type, True))
    if not all(path.exists() for path in wanted):
        _built(base)
    text = llama.quantized(base, GGUF_TYPE, row.quantize_from, row.convert_args, keep_source=False)
    return text, llama.convert(base, row.mmproj_type, mmproj=True)


def _built(base: Path) -> Path:
    """The bf16 source (`base`, where models.QWEN2_5_VL_7B_DIR names it), built now that a file is to be made from
    it: the files are found by its name alone, so it may have been deleted (15 GB) once they were made."""
    import models

    built = models.MODELS[BASE].build()
    if built != base:
        raise RuntimeError(f"the bf16 source was built at {built}, not at {base}")
    return built


def _made_by(command: list[str], out: Path, env: dict[str, str], versions: dict[str, str]) -> None:
    """Run a worker of this file (`command` + OUT) with nice 19 in a scratch directory; record what it took."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:  # what the tools leave in cwd / tmp goes with it
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TMPDIR": scratch, **env}
        subprocess.run(["nice", "-n", "19", *command, str(out)], check=True, env=full_env, cwd=scratch)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    record = json.loads((out / "quant_maker.json").read_text()) | {
        "cpu_seconds": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 1),
        "wall_seconds": round(time.monotonic() - start, 1),
    }
    record["tools"] = record.get("tools", {}) | versions
    (out / "quant_maker.json").write_text(json.dumps(record, indent=2) + "\n")


# ---- workers (each runs in the tool's environment: see the builders above) ---------------------------------------


def _awq_worker(base: Path, out: Path) -> None:
    """AutoAWQ's RTN + GEMM packing of every decoder linear, shard by shard, tensor by tensor; the rest as float16."""
    import importlib.util
    import types

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from testkit.native_quant_checkpoints import DECODER_LINEAR

    # AutoAWQ's package __init__ imports its model zoo (Transformers < 4.52) and its quantizer module imports the
    # calibration loader (`datasets`, absent here and unused without calibration): load its modules under a bare
    # package, with a stand-in for that one import.
    found = importlib.util.find_spec("awq")
    sys.modules["awq"] = package = types.ModuleType("awq")
    package.__path__ = list(found.submodule_search_locations)
    sys.modules.setdefault("datasets", types.SimpleNamespace(load_dataset=None))  # type: ignore[arg-type]
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.packing_utils import dequantize_gemm

    settings = types.SimpleNamespace(w_bit=AWQ_BITS, group_size=AWQ_GROUP, zero_point=True)  # AwqQuantizer's fields

    def packed(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        # AwqQuantizer._apply_quant without the search: the layer in fp16, rounded, then packed from those values.
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.float16)
        rounded, scales, zeros = AwqQuantizer.pseudo_quantize_tensor(settings, weight.half())
        # The same [out, in] values stored column by column: from_linear reads the weight one input column at a
        # time, which is then contiguous (2.6x faster on a 18944x3584 linear here; the words are identical).
        linear.weight.data = rounded.t().contiguous().t()
        gemm = WQLinear_GEMM.from_linear(linear, AWQ_BITS, AWQ_GROUP, scales=scales.t().contiguous(),
                                         zeros=zeros.t().contiguous())  # fmt: skip
        readback = dequantize_gemm(gemm.qweight, gemm.qzeros, gemm.scales, AWQ_BITS, AWQ_GROUP)
        if not torch.equal(readback.t(), rounded):
            raise AssertionError(f"AutoAWQ's readback of {name} is not the weight it packed")
        prefix = name.removesuffix(".weight")
        return {f"{prefix}.{c}": getattr(gemm, c).contiguous() for c in ("qweight", "qzeros", "scales")}

    start = time.monotonic()
    weight_map: dict[str, str] = {}
    linears = 0
    for shard in _shards(base):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(base / shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
                tensor = f.get_tensor(name)
                if DECODER_LINEAR.fullmatch(name):
                    tensors.update(packed(name, tensor))
                    linears += 1
                else:  # the published checkpoint is float16 throughout
                    tensors[name] = tensor.half() if tensor.is_floating_point() else tensor
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard)
        print(f"awq: {shard} ({linears} linears so far, {time.monotonic() - start:.0f} s)", flush=True)
    _write_index(out, weight_map)
    config = json.loads((base / "config.json").read_text())
    config = _with_dtype(config, "float16") | {"quantization_config": AWQ_CONFIG}
    _copy_beside(base, out, config)
    _record(out, base, {"format": "awq gemm", "config": AWQ_CONFIG, "linears_packed": linears,
                  "codes": "round-to-nearest (AwqQuantizer.pseudo_quantize_tensor), no activation-aware search"})  # fmt: skip


def _w8a8_worker(base: Path, out: Path) -> None:
    """llm-compressor's model_free_ptq with the W8A8 preset on the CPU, then the config's ignore list as published."""
    import importlib.metadata

    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from llmcompressor.entrypoints.model_free import model_free_ptq

    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W8A8", ["Linear"])},
                                ignore=W8A8_IGNORE + W8A8_NAME_ONLY_IGNORE)  # fmt: skip
    model_free_ptq(str(base), str(out), config=config, max_workers=1, device="cpu")
    written = json.loads((out / "config.json").read_text())
    written["quantization_config"]["ignore"] = W8A8_IGNORE
    (out / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    versions = {n: importlib.metadata.version(n) for n in ("llmcompressor", "compressed-tensors", "torch")}
    _record(out, base, {"format": written["quantization_config"]["format"], "tools": versions,
                  "scheme": "W8A8 preset: int8 weights per channel (static min-max), dynamic per-token int8 inputs",
                  "name_only_ignore": W8A8_NAME_ONLY_IGNORE})  # fmt: skip


def _shards(base: Path) -> list[str]:
    index = base / "model.safetensors.index.json"
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]


def _write_index(out: Path, weight_map: dict[str, str]) -> None:
    size = sum((out / shard).stat().st_size for shard in set(weight_map.values()))
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _with_dtype(config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The config with `dtype` at every level that has one (Transformers 5 writes it per sub-config)."""
    return {
        k: _with_dtype(v, dtype) if isinstance(v, dict) else (dtype if k == "dtype" else v) for k, v in config.items()
    }


def _copy_beside(base: Path, out: Path, config: dict[str, Any]) -> None:
    """The base's tokenizer, template, processor and generation files, and `config`."""
    for source in base.iterdir():
        if source.is_file() and not source.name.startswith((".", "model")) and source.name != "config.json":
            shutil.copyfile(source, out / source.name)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _record(out: Path, base: Path, facts: dict[str, Any]) -> None:
    (out / "quant_maker.json").write_text(json.dumps({"base": str(base), **facts}, indent=2) + "\n")


# ---- the command -------------------------------------------------------------------------------------------------


def _gib(paths: list[Path]) -> str:
    files = [f for p in paths for f in ([p] if p.is_file() else p.glob("*.safetensors"))]
    return f"{sum(f.stat().st_size for f in files) / 2**30:.2f} GiB"


def make(formats: list[str]) -> dict[str, list[Path]]:
    """Each format's files (made if missing), its size and seconds printed."""
    import models
    import peers

    base = models.QWEN2_5_VL_7B_DIR()  # built only if a file is missing
    made = {}
    for fmt in formats:
        start = time.monotonic()
        made[fmt] = (
            list(gguf_pair(base, peers.LlamaCpp(_llama_server()))) if fmt == "gguf" else [CHECKPOINTS[fmt](base)]
        )
        where = ", ".join(str(p) for p in made[fmt])
        print(f"{fmt}: {_gib(made[fmt])} in {time.monotonic() - start:.0f} s: {where}", flush=True)
    return made


# ---- smoke: one server on one file, one text and one image request ----------------------------------------------

# format -> (models.MODELS alias, the sides `--smoke` starts on it by default)
SMOKE = {"awq": ("qwen2.5-vl-7b-awq", ("ours",)), "w8a8": ("qwen2.5-vl-7b-w8a8", ("ours",)),
         "gguf": ("qwen2.5-vl-7b-awq", ("llama.cpp Q4_K_M + mmproj",))}  # llama.cpp: the row's gguf_source  # fmt: skip
SMOKE_KV_TOKENS, SMOKE_OUTPUT_TOKENS = 8192, 16


def smoke(alias: str, side: str) -> dict[str, Any]:
    """`side` (a peers.side_spec name) started fresh on `alias`: start-up seconds, the tree's RSS after start and at
    its peak, and one short text and one 320x240 image request answered (greedy, 16 tokens, non-streaming)."""
    import httpx
    import models
    import peers
    import workloads

    hf_dir = models.model_dir(alias)
    llama = peers.LlamaCpp(_llama_server()) if side.startswith("llama.cpp") else None
    spec = peers.side_spec(side, models.model_of(alias), hf_dir, slots=1, kv_tokens=SMOKE_KV_TOKENS, llama=llama)
    image = {"type": "image_url", "image_url": {"url": workloads.data_uri(workloads.image_jpeg(51), "image/jpeg")}}
    asks = {"text": "Tell me a story about a red fox.", "image": [image, {"type": "text", "text": "What is in it?"}]}
    log_dir = Path(__file__).resolve().parent / "results" / "quantized-7b-smoke"
    with peers.ManagedServer(spec, log_dir, startup_timeout_s=1800) as server:
        assert server.proc is not None
        sampler = peers.TreeSampler(server.proc.pid)
        facts: dict[str, Any] = {
            "side": side,
            "model": str(spec.model_dir),
            "args": list(spec.extra_args),
            "startup_s": round(server.startup_s, 1),
            "rss_after_start_gib": sampler.sample() / 2**30,
        }
        with peers.every(0.2, sampler.sample):
            for kind, content in asks.items():
                payload = {"model": spec.model_dir, "messages": [{"role": "user", "content": content}],
                           "max_tokens": SMOKE_OUTPUT_TOKENS, "temperature": 0.0,
                           **workloads.length_fields(spec.flavor, SMOKE_OUTPUT_TOKENS)}  # fmt: skip
                start = time.monotonic()
                reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=1800)
                reply.raise_for_status()
                body = reply.json()
                facts[kind] = {"seconds": round(time.monotonic() - start, 1), **body["usage"],
                               "text": body["choices"][0]["message"]["content"][:80]}  # fmt: skip
        facts |= {"peak_rss_gib": sampler.peak_bytes / 2**30, "hwm_sum_gib": sum(sampler.hwm_bytes.values()) / 2**30,
                  "log": str(server.log_path)}  # fmt: skip
    return facts


def _llama_server() -> Path:
    import peers

    server = peers.find_llama_server()
    if server is None:
        raise FileNotFoundError("llama-server not found: build it with `side_by_side.py ... --build` or PEERS.md")
    return server


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("_awq", "_w8a8"):  # a worker, in the tool's environment
        worker = _awq_worker if argv[0] == "_awq" else _w8a8_worker
        worker(Path(argv[1]), Path(argv[2]))
        return 0
    # Only here: the workers run in the tools' environments, where benchmarks/ on the path could shadow their imports.
    sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("formats", nargs="*", choices=("awq", "w8a8", "gguf"), default=["gguf", "awq", "w8a8"])
    p.add_argument("--smoke", action="store_true", help="then start each format's server once: one text, one image")
    p.add_argument("--sides", default=None, help="with --smoke: comma list of peers.side_spec names to start instead")
    args = p.parse_args(argv)
    make(args.formats)
    for fmt in args.formats if args.smoke else ():
        alias, sides = SMOKE[fmt]
        for side in args.sides.split(",") if args.sides else sides:
            print(json.dumps(smoke(alias, side), indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
