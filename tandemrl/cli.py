"""The ``tandemrl`` command: ``train``, ``validate``, ``port`` and ``inspect``.

``validate`` is the dry run: it loads the config exactly as ``train`` would (``defaults:``
inheritance, overrides, interpolation, NeMo-RL names, key and type checks, every
cross-field rule, all in one pass), checks what the run needs on this machine (model folder,
dataset, ``env.target``, a GPU for ``policy.device: cuda``, installed versions; skipped with
``--no-runtime-checks``) and starts nothing. ``port`` prints the TandemRL config a NeMo-RL
config becomes and what could not be carried over. Exit codes: 0 valid, 2 invalid config or
a part of TandemRL that is not available.

``train`` exits 0 when the run finished, 2 when it could not start (nothing was started or
changed; one line per reason), 1 when it failed, and 128 + the signal's number when SIGINT or
SIGTERM stopped it.

Overrides follow the config file in Hydra's syntax: ``a.b=v`` (set), ``+a.b=v`` (add a
key the file does not set), ``++a.b=v`` (set either way), ``~a.b`` (delete).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import yaml

from tandemrl.config import ConfigError, MasterConfig, config_to_dict, load_and_validate

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    # argparse gives a '*' positional only its first run of values; overrides written after
    # an option (``--config F a=1 --print b=2``) arrive as extras, in order.
    args, extras = parser.parse_known_args(argv)
    unknown = [extra for extra in extras if extra.startswith("-") or "overrides" not in args]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extras:
        args.overrides = [*args.overrides, *extras]
    return int(args.handler(args))


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandemrl", description="Asynchronous RL post-training (GRPO, PPO)."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser("train", help="train from a config")
    _add_config_arguments(train)
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="replace another run's metrics in logger.log_dir (at the first step, not before)",
    )
    train.set_defaults(handler=_train)

    validate = commands.add_parser("validate", help="check a config without starting anything")
    _add_config_arguments(validate)
    validate.add_argument("--print", action="store_true", help="print the resolved config as YAML")
    validate.add_argument(
        "--no-runtime-checks",
        action="store_true",
        help="skip the checks of this machine (model folder, dataset file, env.target, GPU)",
    )
    validate.set_defaults(handler=_validate)

    port = commands.add_parser(
        "port",
        help="print the TandemRL config a NeMo-RL config becomes, and what could not be "
        "carried over",
    )
    port.add_argument("config", help="a NeMo-RL (or TandemRL) YAML config")
    port.add_argument("overrides", nargs="*", metavar="a.b.c=value", help="override values")
    port.add_argument(
        "--output", "-o", default=None, help="write the ported YAML here instead of stdout"
    )
    port.set_defaults(handler=_port)

    inspect = commands.add_parser(
        "inspect", help="show what a checkpoint holds and what a restart would resume"
    )
    inspect.add_argument("path", help="checkpoint directory")
    inspect.add_argument(
        "--config",
        default=None,
        help="the run's YAML config: its restore_mode, and a fingerprint check of each bundle",
    )
    inspect.add_argument("--json", action="store_true", help="print the result as JSON")
    inspect.add_argument(
        "overrides", nargs="*", metavar="a.b.c=value", help="override config values (with --config)"
    )
    inspect.set_defaults(handler=_inspect)
    return parser


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML master config")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="a.b.c=value",
        help="override config values: a.b=v, +a.b=v (add), ++a.b=v (add or set), ~a.b (delete)",
    )


def _load_and_validate(args: argparse.Namespace, *, show_warnings: bool) -> MasterConfig | None:
    """The validated config, or None after printing every problem to stderr."""
    try:
        cfg, warnings, notices = load_and_validate(args.config, args.overrides)
    except ConfigError as exc:
        print(f"{args.config}: invalid config", file=sys.stderr)
        for message in exc.messages:
            print(message, file=sys.stderr)
        return None
    for notice in notices:
        print(f"note: {notice}", file=sys.stderr)
    if show_warnings:
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
    return cfg


def _validate(args: argparse.Namespace) -> int:
    cfg = _load_and_validate(args, show_warnings=True)
    if cfg is None:
        return EXIT_INVALID
    if not args.no_runtime_checks:
        from tandemrl.preflight import runtime_problems

        problems = runtime_problems(cfg)
        if problems:
            print(f"{args.config}: cannot run on this machine", file=sys.stderr)
            for message in problems:
                print(message, file=sys.stderr)
            return EXIT_INVALID
    if args.print:
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
    else:
        print(f"{args.config}: valid")
    return EXIT_OK


def _port(args: argparse.Namespace) -> int:
    from tandemrl.config.port import port_config

    try:
        report = port_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"{args.config}: cannot be read", file=sys.stderr)
        for message in exc.messages:
            print(message, file=sys.stderr)
        return EXIT_INVALID
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(report.yaml_text)
    else:
        print(report.yaml_text, end="")
    print(report.summary(args.config), file=sys.stderr)
    return EXIT_OK if report.runs_as_is else EXIT_INVALID


def _train(args: argparse.Namespace) -> int:
    # Refuse an invalid config before importing anything heavy; run_training validates again
    # and logs the warnings itself.
    cfg = _load_and_validate(args, show_warnings=False)
    if cfg is None:
        return EXIT_INVALID
    run_training = _import_part(
        "tandemrl.controller.run", "run_training", "the training controller"
    )
    if run_training is None:
        return EXIT_INVALID
    from tandemrl.preflight import RunRefused

    try:
        result = run_training(cfg, overwrite_logs=args.overwrite)
    except RunRefused as refused:
        print(f"{args.config}: cannot start", file=sys.stderr)
        for message in refused.problems:
            print(message, file=sys.stderr)
        return EXIT_INVALID
    except Exception as exc:
        if cfg.logger.level == "DEBUG":
            traceback.print_exc()
        print(f"tandemrl train: failed: {failure_summary(exc)}", file=sys.stderr)
        if cfg.logger.level != "DEBUG":
            print(
                "(the workers' tracebacks are above; logger.level=DEBUG prints the driver's)",
                file=sys.stderr,
            )
        return EXIT_FAILED
    return result if isinstance(result, int) else EXIT_OK


def failure_summary(exc: BaseException) -> str:
    """One line for a failed run: the innermost cause (a Ray error wraps the worker's own
    exception), its type and the first line of its message."""
    cause: BaseException = exc
    seen: set[int] = set()
    while id(cause) not in seen:
        seen.add(id(cause))
        inner = getattr(cause, "cause", None)  # ray.exceptions.RayTaskError
        if isinstance(inner, BaseException):
            cause = inner
            continue
        if cause.__cause__ is not None:
            cause = cause.__cause__
            continue
        break
    lines = [line for line in str(cause).splitlines() if line.strip()]
    first = lines[0].strip() if lines else ""
    return f"{type(cause).__name__}: {first}" if first else type(cause).__name__


def _inspect(args: argparse.Namespace) -> int:
    if args.config is None and args.overrides:
        print("tandemrl inspect: config overrides need --config", file=sys.stderr)
        raise SystemExit(EXIT_INVALID)
    inspect_command = _import_part(
        "tandemrl.checkpoint.inspect", "inspect_command", "checkpoint inspection"
    )
    if inspect_command is None:
        return EXIT_INVALID
    if args.config is None and not args.json:
        return int(inspect_command(args.path))
    return int(
        inspect_command(args.path, args.config, list(args.overrides), as_json=bool(args.json))
    )


def _import_part(module_name: str, attribute: str, what: str) -> Any:
    """Import ``module_name.attribute`` lazily; None (after a message) when not built yet.

    Only a missing ``module_name`` (or its ``attribute``) counts as "not built yet"; any
    other import failure, such as a missing third-party dependency, propagates.
    """
    try:
        module = __import__(module_name, fromlist=[attribute])
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if not (module_name == missing or module_name.startswith(missing + ".")):
            raise
        print(
            f"tandemrl: {what} ({module_name}) is not built yet in this checkout",
            file=sys.stderr,
        )
        return None
    part = getattr(module, attribute, None)
    if part is None:
        print(
            f"tandemrl: {what} is not built yet: {module_name} has no {attribute}",
            file=sys.stderr,
        )
    return part


if __name__ == "__main__":
    sys.exit(main())
