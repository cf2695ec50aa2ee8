"""The `vlm-engine` command line. Each subcommand registers itself in `COMMANDS`.

vlm-engine serve [--model M] [--host H] [--port P] [--api-key K] [--preprocess-workers N] ...
vlm-engine bench [serve_bench.py options]   (source checkout only: runs benchmarks/serve_bench.py)
vlm-engine batch INPUTS... --prompt P [--schema S] --out rows.jsonl [--model M | --server URL ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from vlm_engine.config import leaf_fields, option_problem, resolve_choices

if TYPE_CHECKING:
    from vlm_engine.server.config import ServerConfig

# ---- flags generated from the config dataclasses (`serve`'s and `batch`'s) -----------------------

# Old spellings that turn a switch off, kept working next to the generated --no-X (deployments use them).
OFF_SWITCHES = {"log_stats": "--disable-log-stats"}
_METAVARS = {int: "N", float: "X"}


def flag_name(name: str) -> str:
    """An option's flag: its name in kebab case, less an `enable_` prefix (a switch has its --no-
    form) and a `_s` unit suffix (its help says seconds). `--prefix-cache / --no-prefix-cache`."""
    return "--" + name.removeprefix("enable_").removesuffix("_s").replace("_", "-")


def _flag(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("flag") or flag_name(f.name)


def _value_type(hint: Any) -> Any:
    """`int | None` -> int, `list[str]` (a repeated flag) -> str: the type of the value a flag gives."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is list:
        return args[0]
    return args[0] if type(None) in typing.get_args(hint) and len(args) == 1 else hint


def _parser(f: dataclasses.Field[Any], value_type: Any) -> Callable[[str], Any]:
    """Text -> the option's value, refused (argparse's usage error, naming the flag) where the
    option's own rule refuses it: the rule the section applies when it is built, with its text."""
    parse = f.metadata.get("parse")
    if parse is None and value_type not in (int, float, str):
        raise TypeError(f"option {f.name!r} of type {value_type} needs a `parse` function in its metadata")
    convert = parse or value_type

    def parse_checked(text: str) -> Any:
        value = convert(text)
        problem = option_problem(f, value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse_checked.__name__ = convert.__name__  # argparse's "invalid int value: 'x'"
    return parse_checked


def _help(f: dataclasses.Field[Any]) -> str:
    text = f.metadata["help"]
    if f.default not in (None, (), dataclasses.MISSING):
        text += f" (default: {f.default})"
    if "env" in f.metadata:
        text += f" (env {f.metadata['env']})"
    return text.replace("%", "%%")


def _metavar(f: dataclasses.Field[Any], value_type: Any) -> str:
    if "metavar" in f.metadata:
        return f.metadata["metavar"]
    return "SECONDS" if f.name.endswith("_s") else _METAVARS.get(value_type, f.name.upper())


def _add_option(group: Any, owner: type, f: dataclasses.Field[Any]) -> None:
    # SUPPRESS: the namespace holds only the options given; every default comes from its field.
    kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": _help(f)}
    value_type = _value_type(typing.get_type_hints(owner)[f.name])
    flag = _flag(f)
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    if value_type is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = _parser(f, value_type)
        choices = resolve_choices(f.metadata.get("choices"))
        if choices:
            kwargs["choices"] = choices
        elif flag.startswith("-"):
            kwargs["metavar"] = _metavar(f, value_type)
    if not flag.startswith("-"):  # a positional argument: one or more values
        kwargs["nargs"] = "+"
    else:
        kwargs["dest"] = f.name
        if f.metadata.get("repeat"):
            kwargs["action"] = "append"
        if required:
            kwargs["required"] = True
    group.add_argument(flag, **kwargs)
    if f.name in OFF_SWITCHES:
        group.add_argument(
            OFF_SWITCHES[f.name], dest=f.name, action="store_false", default=argparse.SUPPRESS,
            help=f"same as --no-{flag_name(f.name)[2:]}",
        )  # fmt: skip


def add_config_flags(parser: argparse.ArgumentParser, config_class: type) -> None:
    """A flag for every option of a config tree, in one argument group per section (a config of
    one section, as `batch`'s, adds its flags to the parser itself)."""
    groups: dict[tuple[str, ...], Any] = {(): parser}
    for path, owner, f in leaf_fields(config_class):
        if path not in groups:
            groups[path] = parser.add_argument_group(path[-1], (owner.__doc__ or "").strip().splitlines()[0])
        _add_option(groups[path], owner, f)


def config_values(args: argparse.Namespace, config_class: type) -> dict[str, Any]:
    """The options given on the command line (or by their environment variable), by name."""
    values: dict[str, Any] = {}
    for _, owner, f in leaf_fields(config_class):
        env = f.metadata.get("env")
        if hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
        elif env is not None and env in os.environ:
            values[f.name] = _parser(f, _value_type(typing.get_type_hints(owner)[f.name]))(os.environ[env])
    return values


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from vlm_engine.server.config import ServerConfig

    p = sub.add_parser("serve", help="serve a model over the OpenAI-compatible HTTP API")
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as --model")
    add_config_flags(p, ServerConfig)
    p.set_defaults(func=run_serve)


def serve_config(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of parsed `serve` arguments: the options given, defaults for the rest."""
    from vlm_engine.server.config import ServerConfig

    values = config_values(args, ServerConfig)
    if "model" not in values and args.model_pos:
        values["model"] = args.model_pos
    return ServerConfig.from_flat(**values)


def run_serve(args: argparse.Namespace) -> int:
    config = serve_config(args)
    if config.ray.ray:
        from vlm_engine.deploy.ray_serve import serve_on_ray

        return serve_on_ray(config)
    from vlm_engine.server.launcher import serve

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
    from vlm_engine.batch.run import BatchOptions

    p = sub.add_parser("batch", help="turn files, folders, manifests or OpenAI batch files into JSON rows")
    add_config_flags(p, BatchOptions)
    p.set_defaults(func=run_batch_command)


def run_batch_command(args: argparse.Namespace) -> int:
    from vlm_engine.batch import BatchOptions, run_batch

    try:
        options = BatchOptions(**config_values(args, BatchOptions))
    except ValueError as exc:  # a rule across options (each option's own is the flag's)
        print(exc, file=sys.stderr)
        return 2
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
