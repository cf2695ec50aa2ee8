"""The config tree (vlm_engine.config, vlm_engine.server.config) and the `serve` flags generated
from it: every option has one flag and one help text, the flags' defaults are the fields', the
old spellings still parse to the same config, and flat option names route to their sections."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import subprocess
import sys
import typing

import pytest

from vlm_engine.cli import OFF_SWITCHES, build_parser, flag_name, serve_config
from vlm_engine.config import EngineConfig, MediaPerPrompt, leaf_fields
from vlm_engine.server.config import ServerConfig

OPTIONS = [(owner, f) for _, owner, f in leaf_fields(ServerConfig)]
WITH_DEFAULT = [(owner, f) for owner, f in OPTIONS if f.default not in (None, ())]


@pytest.fixture(autouse=True)
def _no_api_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLM_ENGINE_API_KEY", raising=False)


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def parse(*argv: str) -> ServerConfig:
    return serve_config(build_parser().parse_args(["serve", *argv]))


def test_option_names_are_unique_across_the_tree() -> None:
    names = [f.name for _, f in OPTIONS]
    assert len(names) == len(set(names)) > 60
    assert {f.name for f in dataclasses.fields(ServerConfig)} == {"engine", "api", "web", "observability", "process", "ray"}


@pytest.mark.parametrize(("owner", "f"), OPTIONS, ids=[f.name for _, f in OPTIONS])
def test_every_option_has_a_flag_with_its_help_and_default(owner: type, f: dataclasses.Field) -> None:
    assert isinstance(f.metadata.get("help"), str) and len(f.metadata["help"]) > 10
    action = serve_parser()._option_string_actions[flag_name(f.name)]
    assert action.dest == f.name
    assert action.help.startswith(f.metadata["help"].replace("%", "%%"))
    if f.default not in (None, ()):
        assert f"(default: {f.default})" in action.help


@pytest.mark.parametrize(("owner", "f"), WITH_DEFAULT, ids=[f.name for _, f in WITH_DEFAULT])
def test_a_flag_given_its_default_as_text_gives_the_default(owner: type, f: dataclasses.Field) -> None:
    """The flag's type is derived right: the default written on the command line parses back to it."""
    if typing.get_type_hints(owner)[f.name] is bool:
        argv = [flag_name(f.name) if f.default else "--no-" + flag_name(f.name)[2:]]
    else:
        argv = [flag_name(f.name), str(f.default)]
    assert getattr(build_parser().parse_args(["serve", *argv]), f.name) == f.default


def test_no_flag_gives_the_dataclass_defaults() -> None:
    assert parse() == ServerConfig()
    assert ServerConfig().engine == EngineConfig()


def test_the_old_spellings_parse_to_the_same_config() -> None:
    """Every flag `vlm-engine serve` had before its flags were generated (docs, tests and
    deployments use them), with the config the hand-written parser built from them."""
    argv = shlex.split("""--model m --served-model-name s --host 0.0.0.0 --port 9000 --api-key k --preprocess-workers 2
    --dtype float32 --device cpu --max-model-len 512 --kv-cache-tokens 4096 --max-num-seqs 8
    --max-num-batched-tokens 256 --no-prefix-cache --attention-backend reference --numerics exact
    --quantization int8 --speculative draft:/d --num-speculative-tokens 3 --speculative-ngram-max 5
    --speculative-disable-batch-size 4 --speculative-draft-quantization int4 --no-warmup
    --max-waiting-requests 7 --limit-mm-per-prompt image=3,video=1 --allowed-local-media-path /m
    --max-image-bytes 1000 --video-fps 4 --video-max-frames 16 --max-video-bytes 2000 --max-video-seconds 60
    --max-video-pixels 3000 --video-device cpu --video-frame-cache-mb 64 --media-fetch-timeout 2.5
    --video-fetch-timeout 9 --max-redirects 1 --media-time-budget 0 --max-concurrent-media-fetches 4
    --allow-private-media-urls --allowed-media-domains a.com,b.org --max-n 2 --max-request-bytes 4096
    --tool-call-parser hermes --app placard --allowed-origins http://a.test/,http://b.test
    --replica-id r1 --disable-log-stats --log-stats-interval 0.5 --request-log /tmp/r.jsonl
    --profile-dir /tmp/p --shutdown-timeout 1.5 --side-process-nice 0 --log-level debug""")
    expected = ServerConfig.from_flat(
        model="m", served_model_name="s", host="0.0.0.0", port=9000, api_key="k", preprocess_workers=2,
        dtype="float32", device="cpu", max_model_len=512, kv_cache_tokens=4096, max_num_seqs=8,
        max_num_batched_tokens=256, enable_prefix_cache=False, attention_backend="reference", numerics="exact",
        quantization="int8", speculative="draft:/d", num_speculative_tokens=3, speculative_ngram_max=5,
        speculative_disable_batch_size=4, speculative_draft_quantization="int4", warmup=False,
        max_waiting_requests=7, limit_mm_per_prompt=MediaPerPrompt(image=3, video=1), allowed_local_media_path="/m",
        max_image_bytes=1000, video_fps=4.0, video_max_frames=16, max_video_bytes=2000, max_video_seconds=60.0,
        max_video_pixels=3000, video_device="cpu", video_frame_cache_mb=64, media_fetch_timeout_s=2.5,
        video_fetch_timeout_s=9.0, max_redirects=1, media_time_budget_s=0.0, max_concurrent_media_fetches=4,
        allow_private_media_urls=True, allowed_media_domains=("a.com", "b.org"), max_n=2, max_request_bytes=4096,
        tool_call_parser="hermes", app="placard", allowed_origins=("http://a.test", "http://b.test"),
        replica_id="r1", log_stats=False, log_stats_interval_s=0.5, request_log="/tmp/r.jsonl",
        profile_dir="/tmp/p", shutdown_timeout_s=1.5, side_process_nice=0, log_level="debug",
    )  # fmt: skip
    config = parse(*argv)
    assert config == expected
    assert config.engine.media.video_frame_cache_bytes == 64 * 2**20
    assert config.model_name == "s" and config.replica == "r1"


@pytest.mark.parametrize(
    ("text", "image", "video"),
    [("5", 5, 2), ("image=4", 4, 2), ("video=0", 8, 0), ("image=1,video=3", 1, 3), ('{"image": 2, "video": 6}', 2, 6)],
)
def test_limit_mm_per_prompt_forms(text: str, image: int, video: int) -> None:
    """A modality left out keeps its default, as before."""
    assert parse("--limit-mm-per-prompt", text).engine.media.limit_mm_per_prompt == MediaPerPrompt(image, video)


def test_switches_and_their_old_spellings() -> None:
    assert parse("--no-prefix-cache").engine.cache.enable_prefix_cache is False
    assert parse("--prefix-cache").engine.cache.enable_prefix_cache is True
    assert parse("--no-chunked-prefill").engine.scheduler.enable_chunked_prefill is False
    for off in ("--disable-log-stats", "--no-log-stats"):
        assert parse(off).observability.log_stats is False
    assert set(OFF_SWITCHES) <= {f.name for _, f in OPTIONS}


def test_model_positional_and_flag() -> None:
    assert parse("some/model").engine.model.model == "some/model"
    assert parse("--model", "flag/model").engine.model.model == "flag/model"
    assert parse("pos/model", "--model", "flag/model").engine.model.model == "flag/model"  # --model wins
    assert parse().model_name == parse().engine.model.model == "placard-default"


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLM_ENGINE_API_KEY", "from-env")
    assert parse().api.api_key == "from-env"
    assert parse("--api-key", "flag").api.api_key == "flag"
    assert parse("--api-key", "").api.api_key is None
    monkeypatch.setenv("VLM_ENGINE_API_KEY", "")
    assert parse().api.api_key is None


@pytest.mark.parametrize(
    "argv",
    [["--max-num-seqs", "0"], ["--speculative", "eagle"], ["--numerics", "turbo"], ["--limit-mm-per-prompt", "audio=1"],
     ["--app", "nope"], ["--video-fps", "0"], ["--port", "x"]],
)  # fmt: skip
def test_bad_values_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *argv])
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err


def test_values_no_flag_can_check_fail_in_the_dataclass() -> None:
    with pytest.raises(ValueError, match="bfloat16 or float32 activations"):
        parse("--quantization", "int8", "--dtype", "float16")
    with pytest.raises(ValueError, match="give quantization"):
        parse("--quantize-vision")
    with pytest.raises(ValueError, match="kv_cache_tokens must hold at least one page"):
        parse("--kv-cache-tokens", "8", "--page-size", "16")


def test_flat_names_route_to_their_sections() -> None:
    config = EngineConfig.from_flat(model="m", page_size=32, max_num_seqs=4, speculative="ngram", video_fps=1.0)
    assert (config.model.model, config.cache.page_size, config.scheduler.max_num_seqs) == ("m", 32, 4)
    assert config.speculative.speculative == "ngram" and config.speculative.draft_path is None
    assert config.media.video_fps == 1.0 and config.media.video_max_frames == 32
    assert EngineConfig.from_flat(speculative="draft:/x").speculative.draft_path == "/x"
    server = ServerConfig.from_flat(port=1, max_num_seqs=3)
    assert server.api.port == 1 and server.engine.scheduler.max_num_seqs == 3
    assert ServerConfig.from_flat(**server.flat()) == server
    assert set(server.flat()) == {f.name for _, f in OPTIONS}
    with pytest.raises(TypeError, match="no option 'kv_tokens'"):
        EngineConfig.from_flat(kv_tokens=1)
    with pytest.raises(TypeError, match="no option 'port'"):
        EngineConfig.from_flat(port=1)  # a server option is not an engine one


def test_engine_rejects_unknown_options_before_loading_anything() -> None:
    from vlm_engine import Engine

    with pytest.raises(TypeError, match="no option 'max_batch'"):
        Engine("no/such/model", max_batch=4)
    with pytest.raises(TypeError, match="not both"):
        Engine(EngineConfig(), dtype="float32")


def test_the_config_and_the_generated_cli_import_no_torch() -> None:
    """The API process imports the config; building the serve parser must not pull torch in."""
    code = (
        "import sys; from vlm_engine.cli import build_parser, serve_config; "
        "serve_config(build_parser().parse_args(['serve', '--app', 'placard'])); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
