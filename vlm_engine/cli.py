"""The `vlm-engine` command line. Each subcommand registers itself in `COMMANDS`.

vlm-engine serve [--model M] [--host H] [--port P] [--api-key K] [--preprocess-workers N] ...
vlm-engine bench [serve_bench.py options]   (source checkout only: runs benchmarks/serve_bench.py)
vlm-engine batch INPUTS... --prompt P [--schema S] --out rows.jsonl [--model M | --server URL ...]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _speculative_method(text: str) -> str:
    if text == "ngram" or (text.startswith("draft:") and len(text) > len("draft:")):
        return text
    raise argparse.ArgumentTypeError(f"must be 'ngram' or 'draft:PATH', got {text!r}")


def _mm_limit(text: str) -> dict[str, int]:
    """`8` (images), `image=8,video=2` or the vLLM JSON form `{"image": 8, "video": 2}`."""
    text = text.strip()
    if text.startswith("{"):
        import json

        limits = {str(k): int(v) for k, v in json.loads(text).items()}
    elif "=" in text:
        limits = {}
        for item in text.split(","):
            key, _, value = item.partition("=")
            limits[key.strip()] = int(value)
    else:
        limits = {"image": int(text)}
    unknown = set(limits) - {"image", "video"}
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown modality {min(unknown)!r}; use image and video")
    return limits


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _origins(text: str) -> tuple[str, ...]:
    return tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from vlm_engine.config import NUMERICS, QUANTIZATIONS
    from vlm_engine.server.apps import APPS
    from vlm_engine.server.config import DEFAULT_MODEL, ServerConfig

    d = ServerConfig()
    p = sub.add_parser("serve", help="serve a model over the OpenAI-compatible HTTP API")
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as --model")
    p.add_argument(
        "--model", default=None, help=f"local directory, .gguf file, hub id, or the embedded {DEFAULT_MODEL!r}"
    )
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument(
        "--api-key",
        default=os.environ.get("VLM_ENGINE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (env VLM_ENGINE_API_KEY)",
    )
    p.add_argument("--preprocess-workers", type=_positive_int, default=d.preprocess_workers)
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=d.device)
    g.add_argument("--max-model-len", type=_positive_int, default=None)
    g.add_argument(
        "--kv-cache-tokens", type=_positive_int, default=None, help="KV pool size (default: from free memory)"
    )
    g.add_argument("--max-num-seqs", type=_positive_int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=d.max_num_batched_tokens)
    g.add_argument("--no-prefix-cache", action="store_true")
    g.add_argument("--attention-backend", default=d.attention_backend)
    g.add_argument(
        "--numerics",
        default=d.numerics,
        choices=list(NUMERICS),
        help="fast: the CPU kernels fastest here (packed linears, fused C++ ops); exact: Transformers' own ops",
    )
    g.add_argument(
        "--quantization",
        default=None,
        choices=list(QUANTIZATIONS),
        help="weight-only int8/int4 decoder linears on CPU (llama.cpp's Q8_0/Q4_1 schemes; a Q4_1 GGUF keeps its codes)",
    )
    g.add_argument(
        "--speculative",
        default=None,
        type=_speculative_method,
        help="speculative decoding: 'ngram' (prompt lookup) or 'draft:PATH' (a smaller model, same vocabulary)",
    )
    g.add_argument(
        "--num-speculative-tokens", type=_positive_int, default=d.num_speculative_tokens, help="draft tokens per step"
    )
    g.add_argument(
        "--speculative-ngram-max", type=_positive_int, default=d.speculative_ngram_max, help="longest n-gram matched"
    )
    g.add_argument(
        "--speculative-disable-batch-size",
        type=_positive_int,
        default=d.speculative_disable_batch_size,
        help="steps that start with this many running requests do not speculate (the batch is compute-bound)",
    )
    g.add_argument(
        "--speculative-draft-quantization",
        default=None,
        choices=list(QUANTIZATIONS),
        help="weight-only int8/int4 linears for the draft model (draft:PATH with the target's own path: a quantized self-draft)",
    )
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up request at start")
    a = p.add_argument_group("admission and media")
    a.add_argument(
        "--max-waiting-requests",
        type=int,
        default=d.max_waiting_requests,
        help="beyond this many waiting requests, answer 503",
    )
    a.add_argument(
        "--limit-mm-per-prompt",
        type=_mm_limit,
        default={"image": d.limit_mm_per_prompt, "video": d.limit_videos_per_prompt},
        help='media per prompt: 8 (images), image=8,video=2 or \'{"image": 8, "video": 2}\'',
    )
    a.add_argument("--allowed-local-media-path", default=None, help="serve local image files from under this directory")
    a.add_argument("--max-image-bytes", type=_positive_int, default=d.max_image_bytes)
    v = p.add_argument_group("video")
    v.add_argument("--video-fps", type=_positive_float, default=d.video_fps, help="frames sampled per second of video")
    v.add_argument("--video-max-frames", type=_positive_int, default=d.video_max_frames, help="most frames per video")
    v.add_argument("--max-video-bytes", type=_positive_int, default=d.max_video_bytes)
    v.add_argument("--max-video-seconds", type=_positive_float, default=d.max_video_seconds)
    v.add_argument(
        "--max-video-pixels",
        type=_positive_int,
        default=d.max_video_pixels,
        help="decoded pixels per video (frames x width x height)",
    )
    v.add_argument(
        "--video-device",
        default=d.video_device,
        choices=["auto", "cpu", "cuda"],
        help="where frames are resized/normalized (decoding is always PyAV on the CPU)",
    )
    v.add_argument(
        "--video-frame-cache-mb",
        type=int,
        default=d.video_frame_cache_bytes // 2**20,
        help="decoded frames each worker keeps for repeated videos (0: none)",
    )
    a.add_argument(
        "--media-fetch-timeout", type=float, default=d.media_fetch_timeout_s, help="seconds for an image URL's download"
    )
    a.add_argument(
        "--video-fetch-timeout", type=float, default=d.video_fetch_timeout_s, help="seconds for a video URL's download"
    )
    a.add_argument("--max-redirects", type=int, default=d.max_redirects)
    a.add_argument(
        "--media-time-budget",
        type=float,
        default=d.media_time_budget_s,
        help="seconds one request's media may take to fetch and decode, all parts together (0: no budget)",
    )
    a.add_argument(
        "--max-concurrent-media-fetches",
        type=int,
        default=d.max_concurrent_media_fetches,
        help="media URL downloads in flight at once, over all requests (more wait their turn)",
    )
    a.add_argument(
        "--allow-private-media-urls",
        action="store_true",
        help="let media URLs reach loopback, private and link-local addresses (refused by default: SSRF)",
    )
    a.add_argument(
        "--allowed-media-domains",
        default=None,
        help="comma-separated hosts media may be fetched from (a domain admits its subdomains)",
    )
    a.add_argument("--max-n", type=_positive_int, default=d.max_n, help="most choices per request")
    a.add_argument("--max-request-bytes", type=_positive_int, default=d.max_request_bytes)
    a.add_argument(
        "--tool-call-parser", default=d.tool_call_parser, help="how tool_choice=auto finds calls in the text (hermes)"
    )
    w = p.add_argument_group("web")
    w.add_argument("--app", default=None, choices=sorted(APPS), help="also serve this web app at /APP (/ redirects)")
    w.add_argument(
        "--allowed-origins",
        type=_origins,
        default=d.allowed_origins,
        help="comma-separated origins allowed by CORS ('*' for any; default: same origin only)",
    )
    m = p.add_argument_group("observability")
    m.add_argument("--replica-id", default=None, help="the `replica` label of every metric (default: hostname:port)")
    m.add_argument(
        "--disable-log-stats", action="store_true", help="no latency/step metrics and no periodic status line"
    )
    m.add_argument(
        "--log-stats-interval", type=float, default=d.log_stats_interval_s, help="seconds between status lines (0: off)"
    )
    m.add_argument("--request-log", default=None, metavar="PATH", help="append one JSON line per finished request")
    m.add_argument(
        "--profile-dir", default=None, metavar="DIR", help="enable POST /start_profile, /stop_profile; traces go here"
    )
    o = p.add_argument_group("process")
    o.add_argument(
        "--shutdown-timeout", type=float, default=d.shutdown_timeout_s, help="seconds in-flight requests get on SIGTERM"
    )
    o.add_argument("--side-process-nice", type=int, default=d.side_process_nice)
    o.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from vlm_engine.server.config import DEFAULT_MODEL, ServerConfig
    from vlm_engine.server.launcher import serve

    config = ServerConfig(
        model=args.model or args.model_pos or DEFAULT_MODEL,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        preprocess_workers=args.preprocess_workers,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        kv_cache_tokens=args.kv_cache_tokens,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_cache=not args.no_prefix_cache,
        attention_backend=args.attention_backend,
        numerics=args.numerics,
        quantization=args.quantization,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_ngram_max=args.speculative_ngram_max,
        speculative_disable_batch_size=args.speculative_disable_batch_size,
        speculative_draft_quantization=args.speculative_draft_quantization,
        warmup=not args.no_warmup,
        max_waiting_requests=args.max_waiting_requests,
        limit_mm_per_prompt=args.limit_mm_per_prompt.get("image", ServerConfig.limit_mm_per_prompt),
        limit_videos_per_prompt=args.limit_mm_per_prompt.get("video", ServerConfig.limit_videos_per_prompt),
        video_fps=args.video_fps,
        video_max_frames=args.video_max_frames,
        max_video_bytes=args.max_video_bytes,
        max_video_seconds=args.max_video_seconds,
        max_video_pixels=args.max_video_pixels,
        video_frame_cache_bytes=max(0, args.video_frame_cache_mb) * 2**20,
        video_device=args.video_device,
        allowed_local_media_path=args.allowed_local_media_path,
        max_image_bytes=args.max_image_bytes,
        media_fetch_timeout_s=args.media_fetch_timeout,
        video_fetch_timeout_s=args.video_fetch_timeout,
        max_redirects=args.max_redirects,
        media_time_budget_s=args.media_time_budget,
        max_concurrent_media_fetches=args.max_concurrent_media_fetches,
        allow_private_media_urls=args.allow_private_media_urls,
        allowed_media_domains=tuple(args.allowed_media_domains.split(",")) if args.allowed_media_domains else None,
        max_n=args.max_n,
        tool_call_parser=args.tool_call_parser,
        app=args.app,
        allowed_origins=args.allowed_origins,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout_s=args.shutdown_timeout,
        replica_id=args.replica_id,
        log_stats=not args.disable_log_stats,
        log_stats_interval_s=args.log_stats_interval,
        request_log=args.request_log,
        profile_dir=args.profile_dir,
        side_process_nice=args.side_process_nice,
        log_level=args.log_level,
    )
    code = serve(config)
    # Skip the interpreter's teardown of torch & co. (seconds): every child is already reaped.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# Subcommands: each adds its parser (and `func`) to the subparsers.
def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    # Every argument goes to benchmarks/serve_bench.py untouched: no prefix chars here, so
    # `--base-url ...` and `--help` are not parsed by this parser.
    p = sub.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server (benchmarks/serve_bench.py)",
        add_help=False,
        prefix_chars="\0",
    )
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    # The package never imports `benchmarks`; the script is run by path from a source checkout.
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_bench.py"
    if not script.exists():
        print(f"vlm-engine bench needs a source checkout ({script} not found)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.bench_args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def add_batch_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="turn files, folders, manifests or OpenAI batch files into JSON rows")
    p.add_argument(
        "inputs", nargs="+", help="files, folders (recursive), globs, a JSONL manifest or an OpenAI batch file"
    )
    p.add_argument("--prompt", default=None, help="what to ask about each input")
    p.add_argument("--schema", default=None, help="a JSON Schema file: answers are constrained to it and parsed")
    p.add_argument("--out", required=True, help="JSONL output; rerunning with the same file resumes")
    p.add_argument("--model", default=None, help="in-process model (default: the embedded default)")
    p.add_argument("--server", action="append", default=[], help="an OpenAI-compatible server URL (repeatable)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=_positive_int, default=16)
    p.add_argument("--fps", type=_positive_float, default=None, help="video frames sampled per second")
    p.add_argument("--max-frames", type=_positive_int, default=None, help="most frames per video")
    p.add_argument("--pdf-pages", choices=["each", "document"], default="each", help="a row per page or per PDF")
    p.add_argument(
        "--pdf-longest-side", type=_positive_int, default=1288, help="pixels of a rendered page's longest side"
    )
    p.add_argument("--retries", type=int, default=2, help="retries for transient errors and unparsable answers")
    p.add_argument("--limit", type=_positive_int, default=None, help="only the first N inputs")
    p.add_argument("--max-tokens", type=_positive_int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--extra-body", default="{}", help="JSON merged into every request body, e.g. '{\"top_p\": 0.9}'")
    p.add_argument(
        "--allow-private-media-urls",
        action="store_true",
        help="in-process model: media URLs may reach loopback, private and link-local addresses (an intranet)",
    )
    p.add_argument("--allowed-media-domains", default=None, help="in-process model: fetch media only from these hosts")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_batch_command)


def run_batch_command(args: argparse.Namespace) -> int:
    import json

    from vlm_engine.batch import BatchOptions, run_batch

    schema = None
    if args.schema:
        with open(args.schema, encoding="utf-8") as f:
            schema = json.load(f)
    options = BatchOptions(
        inputs=args.inputs,
        out=args.out,
        prompt=args.prompt,
        schema=schema,
        model=args.model,
        servers=args.server,
        api_key=args.api_key,
        concurrency=args.concurrency,
        fps=args.fps,
        max_frames=args.max_frames,
        pdf_pages=args.pdf_pages,
        pdf_longest_side=args.pdf_longest_side,
        retries=max(0, args.retries),
        limit=args.limit,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        dtype=args.dtype,
        progress=not args.no_progress,
        extra_body=json.loads(args.extra_body),
        allow_private_media_urls=args.allow_private_media_urls,
        allowed_media_domains=tuple(args.allowed_media_domains.split(",")) if args.allowed_media_domains else None,
    )
    summary = run_batch(options)
    print(summary.line(), file=sys.stderr)
    return 0


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_serve_parser, add_bench_parser, add_batch_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlm-engine", description="A small inference engine for vision-language models"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
