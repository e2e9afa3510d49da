"""The `streamrl` command. Thin: parse arguments, call the module that does the work.

Heavy imports (torch, transformers, aiohttp) happen inside the subcommand that needs them, so
`streamrl validate` answers in well under a second.
"""

from __future__ import annotations

import argparse
import sys


def _job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job spec YAML file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a field of the spec (repeatable), e.g. --set buffer.max_staleness=2",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrl", description="Asynchronous, off-policy, streaming RL for LLM reasoning with tools."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _job_args(sub.add_parser("validate", help="check a job spec; exit 0 if valid"))
    _job_args(sub.add_parser("print-config", help="print the resolved job spec (defaults filled in)"))
    sandbox = sub.add_parser("sandbox", help="the code-execution sandbox")
    sandbox_sub = sandbox.add_subparsers(dest="sandbox_command", required=True)
    sandbox_sub.add_parser("serve", help="serve Code Judge's HTTP API", add_help=False)
    tiny = sub.add_parser("tiny", help="streamrl's tiny CPU models")
    tiny_sub = tiny.add_subparsers(dest="tiny_command", required=True)
    tiny_sub.add_parser("build", help="build and warm-start a tiny model", add_help=False)
    tiny_sub.add_parser("ensure", help="the cached tiny model folder (built on first use)", add_help=False)
    sub.add_parser("launch", help="run a job: plan, start and supervise every role", add_help=False)
    engine = sub.add_parser("engine", help="the embedded rollout engine")
    engine_sub = engine.add_subparsers(dest="engine_command", required=True)
    engine_sub.add_parser("serve", help="serve SGLang's HTTP API around a Hugging Face model", add_help=False)
    sub.add_parser("export", help="write a checkpoint as a Hugging Face model folder", add_help=False)
    sub.add_parser(
        "report", help="plot a run's metrics (RUN_DIR/report/*.png) and print a summary", add_help=False
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["sandbox", "serve"]:
        from sandbox_bridge.server import main as serve

        return serve(argv[2:])
    if argv[:1] == ["tiny"]:
        from streamrl.tiny import main as tiny_main

        return tiny_main(argv[1:])
    if argv[:1] == ["launch"]:
        from streamrl.launch.run import main as launch_main

        return launch_main(argv[1:])
    if argv[:2] == ["engine", "serve"]:
        from workers.engines.embedded import main as engine_serve

        return engine_serve(argv[2:])
    if argv[:1] == ["export"]:
        from streamrl.export import main as export_main

        return export_main(argv[1:])
    if argv[:1] == ["report"]:
        from streamrl.report import main as report_main

        return report_main(argv[1:])
    args = build_parser().parse_args(argv)
    from streamrl.config_load import dump_job, load_job_or_exit

    spec = load_job_or_exit(args.job, args.overrides)
    if args.command == "validate":
        print(f"ok: {args.job} ({spec.name})")
    else:
        sys.stdout.write(dump_job(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
