"""Recipes: the seed's deployments as config files shipped in the package (`turbollm recipes`, `--recipe NAME`).

A recipe is data, never a code path: `NAME.yaml` holds a `recipe:` section (what it is for, the catalog models it
was measured on, its quality check, the command that measures it) and the flags it sets, by their option names,
exactly as a `--config` file holds them. `docs/RECIPES.md` shows each one's measured result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turbollm.errors import TurboLLMError

FOLDER = Path(__file__).parent


class UnknownRecipeError(TurboLLMError):
    pass


class ConfigError(TurboLLMError):
    """A config file or recipe that cannot be applied: unknown key, wrong type, not a mapping, unreadable."""


def read_mapping(path: Path, what: str) -> dict[str, Any]:
    import yaml

    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot be read ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path}: not valid YAML ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path}: the top level must be a mapping of option names to values, "
                          f"not a {type(data).__name__}")
    return data


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    models: list[str]
    check: str
    bench: str
    settings: dict[str, Any] = field(default_factory=dict)  # option name -> value
    path: Path | None = None


def recipe_names() -> list[str]:
    return sorted(p.stem for p in FOLDER.glob("*.yaml"))


def load_recipe(name: str) -> Recipe:
    path = FOLDER / f"{name}.yaml"
    if not path.is_file():
        import difflib

        near = difflib.get_close_matches(name, recipe_names(), n=1)
        raise UnknownRecipeError(f"no recipe {name!r}" + (f"; did you mean {near[0]!r}?" if near else "") +
                                 f" (recipes: {', '.join(recipe_names())})")
    data = read_mapping(path, "recipe")
    meta = data.pop("recipe", None)
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), str) for k in ("description", "check", "bench")) \
            or not isinstance(meta.get("models"), list):
        raise ConfigError(f"recipe {path}: needs a `recipe:` section with description, models (a list), check, bench")
    return Recipe(name, meta["description"].strip(), [str(m) for m in meta["models"]], meta["check"].strip(),
                  meta["bench"].strip(), data, path)
