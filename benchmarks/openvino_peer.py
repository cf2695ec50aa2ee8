"""OpenVINO GenAI as an in-process peer (issue 49; /work/shared/PEERS.md, "OpenVINO GenAI as a peer").

`ensure_venv()` builds a venv of its own (optimum-intel 2.2 exports only under Transformers < 5), `export()` converts
a checkpoint offline with optimum-cli (once per checkpoint and weight format), and `Worker` runs this file with that
venv's python: a ContinuousBatchingPipeline that answers one JSON line (a batch) with one (its seconds), so that a
caller can alternate rounds with our Engine. Only the standard library is imported here."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

CACHE = Path(os.environ.get("VLM_ENGINE_CACHE", Path.home() / ".cache" / "vlm_engine"))
VENV, EXPORTS = CACHE / "openvino-venv", CACHE / "openvino-exports"
# The CPU torch wheel (optimum-intel needs torch to trace; PyPI's default build drags in the CUDA stack).
PINS = ("openvino-genai==2026.4.1.0", "optimum-intel[openvino]==2.2.0", "transformers==4.57.6",
        os.environ.get("OPENVINO_VENV_TORCH", "torch==2.13.0+cpu"))  # fmt: skip


def ensure_venv() -> Path:
    """The venv's python, the venv created and installed first if it is not yet complete (a few minutes)."""
    python, done = VENV / "bin" / "python", VENV / ".vlm_engine_complete"
    if not done.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PINS], check=True)
        # PyPI's torchvision (optimum-intel requires it) links CUDA torch: under torch+cpu `import torchvision`
        # raises as it registers its C++ ops. The exporter needs only its pure-torch parts: guard those imports.
        names = "    _autograd_registrations,\n    _meta_registrations,\n"
        guarded = ("try:\n    from torchvision import _autograd_registrations, _meta_registrations\n"
                   "except (ImportError, RuntimeError):\n    pass\n\n")
        for init in VENV.glob("lib/python*/site-packages/torchvision/__init__.py"):
            init.write_text(init.read_text().replace(names, "").replace("try:\n", guarded + "try:\n", 1))
        done.write_text(" ".join(PINS))
    return python


def legacy_copy(src: Path, dst: Path) -> None:
    """`src` as Transformers 4.57 reads it: weights symlinked, Transformers 5's `rope_parameters` written back as
    `rope_scaling` + `rope_theta`, a list-valued `extra_special_tokens` as `additional_special_tokens`, and the
    image/video processor configs nested in processor_config.json as files of their own."""
    edited = ("config.json", "tokenizer_config.json", "processor_config.json")
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in edited:
            (dst / f.name).symlink_to(f.resolve())
    config, tok, processor = (json.loads((src / n).read_text()) if (src / n).exists() else {} for n in edited)
    for level in (config, config.get("text_config", {})):
        rope = level.pop("rope_parameters", None) or config.get("text_config", {}).get("rope_parameters") or {}
        if "rope_theta" in rope:
            level["rope_theta"] = rope["rope_theta"]
        if "mrope_section" in rope:
            level["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    config.get("vision_config", {}).pop("rope_parameters", None)
    if isinstance(tok.get("extra_special_tokens"), list):
        tok["additional_special_tokens"] = tok.pop("extra_special_tokens")
    files = dict(zip(edited, (config, tok, processor)))
    for key, prefix in (("image_processor", ""), ("video_processor", "video_")):
        if key in processor and not (src / f"{prefix}preprocessor_config.json").exists():
            files[f"{prefix}preprocessor_config.json"] = processor.pop(key)
    for name, content in files.items():
        if content:
            (dst / name).write_text(json.dumps(content, indent=1))


def export(checkpoint: Path, precision: str) -> Path:
    """The OpenVINO IR of `checkpoint` with `precision` weights (fp16, int8, int4), exported once into a cache dir
    keyed by the checkpoint's path and the precision."""
    checkpoint = checkpoint.resolve()
    key = hashlib.sha256(str(checkpoint).encode()).hexdigest()[:8]
    out = EXPORTS / f"{checkpoint.name}-{key}-{precision}"
    if (out / "openvino_tokenizer.xml").exists():
        return out
    bin_dir, env = ensure_venv().parent, {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(dir=EXPORTS.parent) as tmp:
        src, ir = Path(tmp, "src"), Path(tmp, "ir")
        legacy_copy(checkpoint, src)
        subprocess.run([str(bin_dir / "optimum-cli"), "export", "openvino", "--model", str(src), "--task",
                        "image-text-to-text", "--weight-format", precision, str(ir)], check=True, env=env)  # fmt: skip
        if not (ir / "openvino_tokenizer.xml").exists():
            subprocess.run([str(bin_dir / "convert_tokenizer"), str(src), "--with-detokenizer", "-o", str(ir)],
                           check=True, env=env)  # fmt: skip
        EXPORTS.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out, ignore_errors=True)
        ir.rename(out)
    return out


class Worker:
    """OpenVINO's ContinuousBatchingPipeline on `export_dir` in a subprocess of the venv's python, `threads` CPU
    threads; `generate(images, prompt, max_tokens)` runs one batch (uint8 HxWx3 .npy files) to exactly
    `max_tokens` tokens each and returns its seconds (wall, CPU time of the worker's threads)."""

    def __init__(self, export_dir: Path, threads: int, max_batch: int = 8) -> None:
        self.proc = subprocess.Popen([str(ensure_venv()), __file__, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)  # fmt: skip
        self.info = self._ask({"export": str(export_dir), "threads": threads, "max_batch": max_batch})

    def _ask(self, job: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the OpenVINO worker exited ({self.proc.wait()})")
        return json.loads(line)

    def generate(self, images: list[Path], prompt: str, max_tokens: int) -> tuple[float, float]:
        self.last = self._ask({"images": [str(p) for p in images], "prompt": prompt, "max_tokens": max_tokens})
        if self.last["tokens"] != max_tokens * len(images):
            raise RuntimeError(f"OpenVINO generated {self.last['tokens']} tokens, not {max_tokens} x {len(images)}")
        return float(self.last["seconds"]), float(self.last["cpu_s"])

    def close(self) -> None:
        self.proc.communicate(timeout=60)  # closes its stdin: the worker's loop ends


def worker() -> None:
    """The venv side: the first line sets up the pipeline, each further line is one batch, timed from the
    `generate` call to its return (image preprocessing, prefill and decode)."""
    import time

    import numpy as np
    import openvino as ov
    import openvino_genai as g

    setup = json.loads(sys.stdin.readline())
    sched = g.SchedulerConfig()
    sched.max_num_seqs, sched.cache_size, sched.max_num_batched_tokens = setup["max_batch"], 2, 4096
    props = {"KV_CACHE_PRECISION": "bf16", "INFERENCE_NUM_THREADS": setup["threads"]}
    pipe = g.ContinuousBatchingPipeline(setup["export"], sched, "CPU", props)
    precision = str(ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT"))
    print(json.dumps({"openvino": ov.__version__, "inference_precision": precision}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        cfg = g.GenerationConfig()
        cfg.max_new_tokens = cfg.min_new_tokens = job["max_tokens"]
        cfg.ignore_eos, cfg.do_sample = True, False
        images = [[ov.Tensor(np.load(p)[None])] for p in job["images"]]
        start, cpu = time.perf_counter(), time.process_time()
        results = pipe.generate([job["prompt"]] * len(images), images=images, generation_config=[cfg] * len(images))
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        metrics = results[0].perf_metrics  # one for the whole batch: every request's tokens
        tokens, prompts = int(metrics.get_num_generated_tokens()), int(metrics.get_num_input_tokens())
        print(json.dumps({"seconds": seconds, "cpu_s": cpu, "tokens": tokens, "prompt_tokens": prompts}), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    worker()
