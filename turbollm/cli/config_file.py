"""`--config FILE.yaml` and `--recipe NAME`: a command's flags read from a YAML mapping.

The keys are the command's own option names (`max_num_seqs` or `max-num-seqs`, the engine arguments'
names), the values YAML scalars, lists for options that take several values, and a mapping or a JSON
string for a JSON option (`speculative_config`). A recipe (`turbollm/recipes/NAME.yaml`, `turbollm
recipes`) is such a file shipped in the package, with a `recipe:` section describing it that is not
applied. Precedence: the command's defaults, then the recipe, then the config file, then the flags
on the command line. Every key and value is checked before anything runs: an unknown key is refused
with the nearest valid names, a value of the wrong type with what the option takes.
"""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path
from typing import Any

from turbollm.recipes import ConfigError, load_recipe, read_mapping

NOT_SETTABLE = {"help", "config", "recipe", "version", "func"}


def add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="read this command's flags from a YAML file (keys: the option names, e.g. max_num_seqs); "
                        "flags given on the command line win")
    p.add_argument("--recipe", default=None, metavar="NAME",
                   help="start from a shipped recipe (`turbollm recipes` lists them; a --config file and the "
                        "command line override it)")


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions
            if a.dest not in NOT_SETTABLE and a.option_strings and not isinstance(a, argparse._SubParsersAction)}


def _convert(action: argparse.Action, key: str, value: Any, where: str) -> Any:
    flag = action.option_strings[-1] if action.option_strings else key
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):  # a switch
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key} is a switch ({flag}): give true or false, not {value!r}")
        return value  # (a store_false switch's dest names the positive sense: `webui: false` is --no-webui)
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        return [_convert_one(action, key, v, where, flag) for v in items]
    if isinstance(value, list):
        raise ConfigError(f"{where}: {key} takes one value, not a list")
    return _convert_one(action, key, value, where, flag)


def _convert_one(action: argparse.Action, key: str, value: Any, where: str, flag: str) -> Any:
    typ = action.type
    if isinstance(value, dict):
        if typ not in (None, str):
            raise ConfigError(f"{where}: {key} takes a {typ.__name__}, not a mapping")
        value = json.dumps(value)  # a JSON option written as a YAML mapping
    elif isinstance(value, bool) and typ is not None and typ is not str:
        raise ConfigError(f"{where}: {key} takes a {getattr(typ, '__name__', 'value')}, not {value!r}")
    if typ in (int, float):
        if isinstance(value, str) or (typ is int and isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{where}: {key} takes {'an integer' if typ is int else 'a number'}, not {value!r}")
        value = typ(value)
    elif typ is not None and typ is not str:
        try:
            value = typ(str(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise ConfigError(f"{where}: {key} = {value!r}: {e}") from None
    elif not isinstance(value, str):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        else:
            raise ConfigError(f"{where}: {key} takes a string, not {value!r}")
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where}: {key} = {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def check_settings(parser: argparse.ArgumentParser, values: dict[str, Any], where: str) -> dict[str, Any]:
    """The mapping's values as the parser's defaults would hold them, by dest; ConfigError on the first bad one."""
    actions = _actions(parser)
    out: dict[str, Any] = {}
    for raw_key, value in values.items():
        key = str(raw_key).replace("-", "_")
        action = actions.get(key)
        if action is None:
            near = difflib.get_close_matches(key, list(actions), n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(near)}?" if near else f"; valid names: {', '.join(sorted(actions))}"
            raise ConfigError(f"{where}: unknown key {raw_key!r} for `{parser.prog}`{hint}")
        out[key] = _convert(action, str(raw_key), value, where)
    return out


def apply_config(parser: argparse.ArgumentParser, command: argparse.ArgumentParser, ns: argparse.Namespace,
                 argv: list[str] | None) -> argparse.Namespace:
    """`ns` again, parsed with the recipe's and the config file's values as `command`'s defaults (the flags on the
    command line still win); `ns` itself when neither was given."""
    recipe, config = getattr(ns, "recipe", None), getattr(ns, "config", None)
    if recipe is None and config is None:
        return ns
    values: dict[str, Any] = {}
    if recipe is not None:
        values.update(check_settings(command, load_recipe(recipe).settings, f"recipe {recipe!r}"))
    if config is not None:
        data = read_mapping(Path(config), "config file")
        if isinstance(data.get("recipe"), dict):  # a recipe file used as a config: its description is not a flag
            data.pop("recipe")
        values.update(check_settings(command, data, f"config file {config}"))
    command.set_defaults(**values)
    return parser.parse_known_args(argv)[0]
