"""Where model files come from: the catalog, `turbollm pull`, and name → file resolution."""

from turbollm.hub.catalog import CATALOG, CatalogEntry, get_entry
from turbollm.hub.pull import pull
from turbollm.hub.resolve import ResolvedModel, resolve_model

__all__ = ["CATALOG", "CatalogEntry", "get_entry", "pull", "ResolvedModel", "resolve_model"]
