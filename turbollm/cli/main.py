"""Entry point of the `turbollm` command: parse, dispatch, and turn our errors into one clear line."""

from __future__ import annotations

import argparse
import sys

from turbollm.cli.bench_cmd import add_bench
from turbollm.cli.chat_cmd import add_chat
from turbollm.cli.config_file import apply_config
from turbollm.cli.eval_cmd import add_eval
from turbollm.cli.generate_cmd import add_generate
from turbollm.cli.models_cmd import add_models, add_pull
from turbollm.cli.plan_cmd import add_plan
from turbollm.cli.proxy_cmd import add_proxy
from turbollm.cli.quantize_cmd import add_quantize
from turbollm.cli.recipes_cmd import add_recipes
from turbollm.cli.serve_cmd import add_serve
from turbollm.cli.tune_cmd import add_tune
from turbollm.errors import TurboLLMError

COMMANDS = [add_pull, add_models, add_generate, add_chat, add_eval, add_bench, add_serve, add_proxy, add_quantize,
            add_recipes, add_plan, add_tune]


def build_parser() -> argparse.ArgumentParser:
    from turbollm import __version__

    parser = argparse.ArgumentParser(prog="turbollm", description="turbollm: LLM inference engine")
    parser.add_argument("--version", action="version", version=f"turbollm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def chosen_parser(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command `ns` names (`turbollm bench latency` -> bench's latency parser)."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(ns, subs[0].dest, None) if subs else None
        if name is None or name not in subs[0].choices:
            return parser
        parser = subs[0].choices[name]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra:  # reported by the subcommand's own parser: its usage line, not the top-level one
        chosen_parser(parser, ns).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(ns, "func", None):
        parser.print_help()
        return 2
    try:
        ns = apply_config(parser, chosen_parser(parser, ns), ns, argv)  # --recipe / --config, flags still win
        ns.argv = list(argv) if argv is not None else sys.argv[1:]  # (a launcher passes the flags on)
        return int(ns.func(ns) or 0)
    except TurboLLMError as e:
        print(f"turbollm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("turbollm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
