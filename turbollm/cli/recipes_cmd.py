"""`turbollm recipes [show NAME]`: the shipped recipes (turbollm/recipes/), used with `--recipe NAME`."""

from __future__ import annotations

import argparse
import textwrap


def add_recipes(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recipes", help="list the shipped recipes (config files for the seed's deployments)")
    rsub = p.add_subparsers(dest="recipes_command", metavar="show")
    show = rsub.add_parser("show", help="print a recipe's file (usable as --config, or with --recipe NAME)")
    show.add_argument("name", metavar="NAME")
    p.set_defaults(func=run_recipes)


def run_recipes(ns: argparse.Namespace) -> int:
    from turbollm.recipes import load_recipe, recipe_names

    if getattr(ns, "recipes_command", None) == "show":
        recipe = load_recipe(ns.name)
        print(recipe.path.read_text(), end="")
        return 0
    pad = " " * 15
    for name in recipe_names():
        r = load_recipe(name)
        print(textwrap.fill(r.description, 110, initial_indent=f"{name:<15}", subsequent_indent=pad))
        print(textwrap.fill(f"measured on: {', '.join(r.models)}; quality check: {r.check}", 110,
                            initial_indent=pad, subsequent_indent=pad))
        print(f"{pad}{r.bench}\n")
    print("Use one with --recipe NAME on serve, generate, chat or bench; `turbollm recipes show NAME` prints its "
          "file, a starting point for --config FILE.yaml.")
    return 0
