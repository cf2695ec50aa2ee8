"""Issue-2 speed check: SmolLM2-135M through `Engine.chat` at batch 1 and batch 32, beside
Hugging Face `generate` run one prompt after another, and a bare forward-pass loop (host overhead).

    .venv/bin/python benchmarks/engine_throughput.py [--tokens 64] [--dtype float32] [--json out.json]

All runs share one process and one machine; numbers are output tokens per second of wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vlm_engine import Engine, SamplingParams  # noqa: E402
from vlm_engine.attention.base import AttentionMetadata  # noqa: E402
from vlm_engine.models.layers import ForwardContext  # noqa: E402
from vlm_engine.models.registry import resolve_model  # noqa: E402

TOPICS = ["the sea", "a mountain", "coffee", "a red fox", "the moon", "trains", "a library", "rain",
          "autumn leaves", "a lighthouse", "bees", "the desert"]


def conversations(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Write a few sentences about {TOPICS[i % len(TOPICS)]} (#{i})."}]
            for i in range(n)]


def engine_tok_s(engine: Engine, batch: int, tokens: int, rounds: int = 1) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    produced = 0
    for _ in range(rounds):
        outs = engine.chat(conversations(batch), params)
        produced += sum(len(o.token_ids) for o in outs)
    return produced / (time.perf_counter() - start)


def engine_decode_ms(engine: Engine, tokens: int) -> float:
    """Median wall time of one batch-1 decode step through the whole engine (schedule, forward,
    sample, update, detokenize), measured after the prompt's prefill."""
    rid = engine.add_request(engine.process_messages(conversations(1)[0]),
                             SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill + first token
    times = []
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    del rid
    return 1000 * sorted(times)[len(times) // 2]


def hf_sequential_tok_s(prompts: int, tokens: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model("SmolLM2-135M-Instruct")
    tokenizer = AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(str(source.directory), gguf_file=source.gguf_file, dtype=torch.float32)
    produced = 0
    start = time.perf_counter()
    for messages in conversations(prompts):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        produced += out.shape[1] - ids["input_ids"].shape[1]
    return produced / (time.perf_counter() - start)


def bare_forward_ms(engine: Engine, context: int, tokens: int) -> float:
    """Our model's decode forward + argmax in a loop with prebuilt inputs: no scheduler, no detokenizer.

    Returns the median milliseconds per step."""
    model, runner = engine.model, engine.runner
    ps = engine.config.cache.page_size
    pages = torch.arange((context + tokens) // ps + 1, dtype=torch.int32)
    with torch.inference_mode():
        token = torch.tensor([1])
        times = []
        for step in range(tokens):
            start = time.perf_counter()
            pos = context + step
            meta = AttentionMetadata(
                query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                seq_lens=torch.tensor([pos + 1], dtype=torch.int32),
                block_table=pages[None, :],
                slot_mapping=torch.tensor([int(pages[pos // ps]) * ps + pos % ps]),
                query_lens_host=[1],
                seq_lens_host=[pos + 1],
            )
            ctx = ForwardContext(meta, runner.kv_caches, runner.attn_backend, runner.fused_ops)
            hidden = model(model.embed(token), torch.tensor([pos]), ctx)
            token = model.compute_logits(hidden).argmax(-1)
            token.item()
            times.append(time.perf_counter() - start)
        return 1000 * sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=lambda t: [int(b) for b in t.split(",")], default=[32], help="comma list")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--hf-prompts", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args()

    engine = Engine("SmolLM2-135M-Instruct", dtype=args.dtype, attention_backend=args.attention,
                    kv_cache_tokens=64 * 1024)
    engine.chat(conversations(2), SamplingParams(max_tokens=4, temperature=0))  # warm-up
    prompt_len = len(engine.process_messages(conversations(1)[0]).token_ids)
    results = {
        "machine": f"{os.cpu_count()} cpus, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "dtype": args.dtype,
        "attention": engine.runner.attn_backend.name,
        "output_tokens_per_request": args.tokens,
        "engine_batch1_tok_s": engine_tok_s(engine, 1, args.tokens, rounds=2),
        **{f"engine_batch{b}_tok_s": engine_tok_s(engine, b, args.tokens) for b in args.batch},
        "engine_batch1_decode_ms_per_step": engine_decode_ms(engine, args.tokens),
        "bare_forward_batch1_ms_per_step": bare_forward_ms(engine, prompt_len, args.tokens),
    }
    results["hf_generate_sequential_tok_s"] = hf_sequential_tok_s(args.hf_prompts, args.tokens)
    results[f"batch{args.batch[0]}_vs_hf_sequential"] = results[f"engine_batch{args.batch[0]}_tok_s"] / results["hf_generate_sequential_tok_s"]
    results["engine_vs_bare_decode_step"] = (
        results["engine_batch1_decode_ms_per_step"] / results["bare_forward_batch1_ms_per_step"]
    )
    for key, value in results.items():
        print(f"{key:36s} {value:.2f}" if isinstance(value, float) else f"{key:36s} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
