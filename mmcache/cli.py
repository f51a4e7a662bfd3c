"""The `mmcache` command line: demo, bench, settings."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

import mmcache
from mmcache.core.policy import POLICY_NAMES
from mmcache.demo import DEMO_CPU_MB, DEMO_GPU_MB, DemoConfig, DemoError, run_demo
from mmcache.errors import MMCacheError
from mmcache.settings import SETTINGS_TABLE, CacheSettings, redact_url

__all__ = ["find_benchmarks", "main"]

#: Width that `mmcache settings` wraps its descriptions to (a terminal's usual 80).
SETTINGS_WIDTH = 80


def _number(text: str, kind: type[int] | type[float], what: str) -> float:
    """text as kind, or an argparse error that says what was expected."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = int(_number(text, int, "a whole number >= 1"))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value}")
    return value


def _integer(text: str) -> int:
    return int(_number(text, int, "a whole number"))


def _non_negative(text: str) -> float:
    value = _number(text, float, "a number >= 0")
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _port(text: str) -> int:
    value = int(_number(text, int, "a port 0..65535 (0: any free one)"))
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port 0..65535 (0: any free one), got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmcache", description="Tiered GPU -> pinned host cache of multimodal features."
    )
    parser.add_argument("--version", action="version", version=f"mmcache {mmcache.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    defaults = DemoConfig()
    demo = commands.add_parser(
        "demo",
        help="serve a vision-language workload through the cache and verify every read",
        description="Serve a vision-language workload through the cache and verify every read; "
        "exit 0 only when every read matched what the encoder produced and nothing leaked.",
    )
    demo.add_argument(
        "--device",
        choices=("auto", "sim", "cuda"),
        default=defaults.device,
        help="auto (default): cuda when a GPU is present, else the CPU simulator",
    )
    counts: tuple[tuple[str, Callable[[str], int], str], ...] = (
        ("requests", _positive_int, "requests to serve"),
        ("concurrency", _positive_int, "requests served at once"),
        ("seed", _integer, "seed of the workload and the features"),
        ("hidden", _positive_int, "feature width in bf16 values"),
        ("images", _positive_int, "images in the catalogue, drawn with Zipf popularity"),
    )
    for name, kind, what in counts:
        default = getattr(defaults, name)
        help_text = f"{what} (default: {default})"
        demo.add_argument(f"--{name}", type=kind, default=default, help=help_text)
    for flag, field, tier, fallback in (
        ("--gpu-mb", "gpu_cache_mb", "GPU", DEMO_GPU_MB),
        ("--cpu-mb", "cpu_cache_mb", "host", DEMO_CPU_MB),
    ):
        variables = " or ".join(CacheSettings.env_names(field))
        demo.add_argument(
            flag,
            type=_non_negative,
            default=None,
            metavar="MIB",
            help=f"{tier} tier budget in MiB (default: {variables} if set, else {fallback})",
        )
    demo.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help="serve Prometheus metrics on this port while running, at MMCACHE_METRICS_ADDR "
        "(default: every interface) as the library does (0: any free port; "
        "default: MMCACHE_METRICS_PORT if set, else none)",
    )
    demo.add_argument(
        "--linger",
        type=_non_negative,
        default=0.0,
        metavar="S",
        help="keep the metrics server up S seconds after the run, with the final values, so "
        "that Prometheus scrapes them (it scrapes every 15 s by default; default: 0)",
    )
    demo.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        default=None,
        help="both tiers' eviction policy (default: MMCACHE_EVICTION_POLICY if set, else lru)",
    )
    demo.add_argument("--quiet", action="store_true", help="no progress lines")
    demo.add_argument(
        "--remote-url",
        default=None,
        metavar="URL",
        help="share features through this Redis/Valkey (redis://host:6379/0, ...): evicted "
        "features and an earlier run's come back as remote hits (default: MMCACHE_REMOTE_URL "
        "if set, else none)",
    )

    bench = commands.add_parser(
        "bench",
        help="run the benchmark scripts (benchmarks/bench_*.py)",
        description="Run benchmarks/bench_*.py (all, or those named) with this python. "
        "Arguments after `--` are passed to every script.",
    )
    bench.add_argument(
        "names", nargs="*", help="e.g. serving, offload, bench_offload or bench_offload.py"
    )
    bench.add_argument("--quick", action="store_true", help="passed through: shorter runs")
    bench.add_argument("--dir", type=Path, default=None, help="benchmarks directory to use")

    commands.add_parser("settings", help="list every setting, its variables and current value")
    # Each command's own parser, to name its usage in its errors (not the top level's).
    parser.set_defaults(command_parsers=commands.choices)
    return parser


def find_benchmarks(directory: Path | None = None) -> list[Path]:
    """The bench_*.py scripts of the given directory, or of ./benchmarks, or of the checkout."""
    if directory is not None:
        candidates = [directory]
    else:
        checkout = Path(mmcache.__file__).resolve().parents[1] / "benchmarks"
        candidates = [Path.cwd() / "benchmarks", checkout]
    for candidate in candidates:
        scripts = sorted(candidate.glob("bench_*.py"))
        if scripts:
            return scripts
    return []


def _bench(names: Sequence[str], quick: bool, directory: Path | None, extra: Sequence[str]) -> int:
    scripts = find_benchmarks(directory)
    if not scripts:
        where = (
            [str(directory)]
            if directory is not None
            else [
                str(Path.cwd() / "benchmarks"),
                str(Path(mmcache.__file__).resolve().parents[1] / "benchmarks"),
            ]
        )
        print(
            f"no bench_*.py in {' or '.join(where)}: the benchmarks come with mmcache's source "
            "checkout, not with the installed package; run this from a checkout, or pass "
            "--dir with its benchmarks folder",
            file=sys.stderr,
        )
        return 2
    if names:
        by_name = {s.stem.removeprefix("bench_"): s for s in scripts}
        chosen = []
        for name in names:
            script = by_name.get(Path(name).stem.removeprefix("bench_"))
            if script is None:
                known = ", ".join(by_name)
                print(f"unknown benchmark {name!r}; available: {known}", file=sys.stderr)
                return 2
            chosen.append(script)
        scripts = chosen
    failed = []
    for script in scripts:
        command = [sys.executable, str(script), *(["--quick"] if quick else []), *extra]
        print(f"=== {script.name}: {' '.join(command[1:])}", flush=True)
        # Relayed line by line through our stdout so callers that capture it see it too.
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(line, end="", flush=True)
        if proc.returncode != 0:
            print(f"=== {script.name} failed with exit status {proc.returncode}", flush=True)
            failed.append(script.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _settings() -> int:
    try:
        current = CacheSettings()
    except MMCacheError as e:
        print(f"invalid settings in the environment:\n{e}", file=sys.stderr)
        return 1
    blocks = []
    for row in SETTINGS_TABLE:
        value = getattr(current, row.field)
        if isinstance(value, str):
            value = redact_url(value)
        shown = f"{value} (from {current.env_name(row.field)})" if value != row.default else value
        lines = [f"{row.field} = {shown}   (default {row.default})"]
        lines += textwrap.wrap(
            f"{' / '.join(row.env_names)}: {row.description}",
            width=SETTINGS_WIDTH,
            initial_indent="    ",
            subsequent_indent="    ",
        )
        blocks.append("\n".join(lines))
    print("\n".join(blocks))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `mmcache` command line; returns the exit status."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        print("mmcache: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:
        # The reader went away (`mmcache settings | head`): stop quietly, as other tools do.
        # Output still buffered would fail again at exit: it goes nowhere instead.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _main(args_in: list[str]) -> int:
    extra: list[str] = []
    if "--" in args_in:  # everything after `--` is for the benchmark scripts
        cut = args_in.index("--")
        args_in, extra = args_in[:cut], args_in[cut + 1 :]
    parser = _parser()
    args, unknown = parser.parse_known_args(args_in)
    if unknown:
        own = args.command_parsers.get(args.command, parser)
        own.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra and args.command != "bench":
        parser.error("arguments after `--` are only for `mmcache bench`")
    if args.command == "demo":
        config = DemoConfig(
            device=args.device,
            requests=args.requests,
            concurrency=args.concurrency,
            seed=args.seed,
            gpu_mb=args.gpu_mb,
            cpu_mb=args.cpu_mb,
            hidden=args.hidden,
            images=args.images,
            metrics_port=args.metrics_port,
            linger_s=args.linger,
            quiet=args.quiet,
            remote_url=args.remote_url,
            eviction_policy=args.policy,
        )
        if args.device == "cuda" and not _cuda_available():
            print("--device cuda: no CUDA device here; use --device sim", file=sys.stderr)
            return 2
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _stop_the_demo)
        try:
            return run_demo(config)
        except (MMCacheError, DemoError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.command == "bench":
        return _bench(args.names, args.quick, args.dir, extra)
    if args.command == "settings":
        return _settings()
    parser.print_help(sys.stderr)
    return 2


def _stop_the_demo(signum: int, frame: object) -> None:
    """Ctrl-C: one line and status 130, at once. The demo keeps nothing that outlives its
    process, while unwinding its serving tasks after a cancel can wait a long time."""
    sys.stdout.flush()
    print("mmcache: interrupted", file=sys.stderr, flush=True)
    os._exit(128 + signal.SIGINT)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
