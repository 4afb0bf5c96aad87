"""`turbollm pull NAME` and `turbollm models`."""

from __future__ import annotations

import argparse

from turbollm.hub.catalog import CATALOG, DEFAULT_MODEL, cached_path
from turbollm.hub.pull import is_cached, pull


def add_pull(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="download a catalog model into the cache")
    p.add_argument("name", nargs="+", help="catalog name(s): " + ", ".join(CATALOG))
    p.add_argument("--force", action="store_true", help="download again even if cached")
    p.add_argument("--quiet", "-q", action="store_true")
    p.set_defaults(func=run_pull)


def run_pull(ns: argparse.Namespace) -> int:
    for name in ns.name:
        path = pull(name, quiet=ns.quiet, force=ns.force)
        print(path)
    return 0


def add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the catalog and what is cached")
    p.set_defaults(func=run_models)


def run_models(ns: argparse.Namespace) -> int:
    print(f"{'name':<22}{'arch':<8}{'cached':<8}{'size':>9}  description")
    for name, e in CATALOG.items():
        cached = is_cached(e)
        size = f"{cached_path(e).stat().st_size / 1e6:,.0f} MB" if cached else "-"
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name:<22}{e.arch:<8}{'yes' if cached else 'no':<8}{size:>9}  {e.description}{default}")
    return 0
