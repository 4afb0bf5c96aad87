"""`--config FILE.yaml` and `--recipe NAME` (model-free): keys checked against the command's own options with the
nearest name suggested, values converted and type-checked, precedence defaults < recipe < config < command line,
every shipped recipe valid on every command that takes engine flags, `turbollm recipes` and its errors."""

from __future__ import annotations

import argparse
import json

import pytest

from turbollm.cli.config_file import ConfigError, apply_config, check_settings
from turbollm.cli.engine_flags import engine_args_from
from turbollm.cli.main import build_parser, chosen_parser, main
from turbollm.recipes import UnknownRecipeError, load_recipe, recipe_names


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    assert not extra
    return apply_config(parser, chosen_parser(parser, ns), ns, argv)


def test_precedence_defaults_recipe_config_command_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max-num-seqs: 7\nkv_cache_dtype: int8\nenable_prefix_caching: false\nport: 9001\n")
    ns = parse(["serve", "smollm2-135m", "--recipe", "throughput", "--config", str(cfg), "--max-num-seqs", "3"])
    assert ns.max_num_seqs == 3  # command line over the config file
    assert ns.kv_cache_dtype == "int8" and ns.enable_prefix_caching is False and ns.port == 9001  # config file
    assert ns.max_num_batched_tokens == 4096  # the recipe
    assert ns.threads is None  # the command's default
    args = engine_args_from(ns)
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.kv_cache_dtype) == (3, 4096, "int8")
    plain = parse(["serve", "smollm2-135m"])
    assert plain.max_num_seqs == 64 and plain.kv_cache_dtype == "auto"  # no leak into a fresh parser


def test_json_option_as_a_mapping_and_lists(tmp_path):
    ns = parse(["generate", "--recipe", "large-model"])
    assert json.loads(ns.speculative_config) == {"method": "ngram", "num_speculative_tokens": 4}
    assert ns.tensor_parallel_size == 2
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("kv_policy: [dense, streaming]\nkv_cache_dtype: float16\nkv_window: 256\n")
    ns = parse(["bench", "kv", "--config", str(cfg)])
    assert ns.kv_policy == ["dense", "streaming"] and ns.kv_cache_dtype == ["float16"]  # several-valued: lists


@pytest.mark.parametrize("text, message", [
    ("max_num_seq: 4\n", "unknown key 'max_num_seq' for `turbollm serve`; did you mean max_num_seqs"),
    ("max_num_seqs: four\n", "max_num_seqs takes an integer, not 'four'"),
    ("max_num_seqs: 2.5\n", "max_num_seqs takes an integer, not 2.5"),
    ("kv_cache_memory: yes\n", "kv_cache_memory takes a float, not True"),
    ("enable_prefix_caching: 1\n", "enable_prefix_caching is a switch (--no-enable-prefix-caching): give true or false"),
    ("kv_cache_dtype: int7\n", "kv_cache_dtype = 'int7' is not one of"),
    ("max_num_seqs: [1, 2]\n", "max_num_seqs takes one value, not a list"),
    ("- max_num_seqs\n", "the top level must be a mapping"),
    ("max_num_seqs: [\n", "not valid YAML"),
])
def test_bad_config_is_refused_before_anything_runs(tmp_path, text, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse(["serve", "smollm2-135m", "--config", str(cfg)])


def test_cli_reports_config_errors_in_one_line(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("max_batched_tokens: 4\n")
    assert main(["generate", "--config", str(cfg)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("turbollm: error: config file") and "did you mean max_num_batched_tokens" in err
    assert main(["generate", "--config", str(tmp_path / "missing.yaml")]) == 1
    assert "cannot be read" in capsys.readouterr().err
    assert main(["serve", "--recipe", "edgy"]) == 1
    assert "no recipe 'edgy'; did you mean 'edge'?" in capsys.readouterr().err


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_applies_to_every_engine_command(name):
    recipe = load_recipe(name)
    assert recipe.description and recipe.models and recipe.check and recipe.bench.startswith("turbollm bench")
    parser = build_parser()
    for argv in (["serve", "x"], ["generate"], ["chat"], ["bench", "throughput"], ["bench", "latency"]):
        ns = parser.parse_known_args(argv)[0]
        check_settings(chosen_parser(parser, ns), recipe.settings, f"recipe {name}")
    ns = parse(["generate", "--recipe", name])
    engine_args_from(ns)  # EngineArgs' own checks pass (cross-technique refusals included)


def test_recipes_command(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name in ("edge", "throughput", "large-model", "long-context"):
        assert out.count(f"\n{name} ") + out.startswith(f"{name} ") == 1
    assert main(["recipes", "show", "edge"]) == 0
    shown = capsys.readouterr().out
    assert "quantization: int8" in shown and shown.startswith("# The seed's edge deployment")
    with pytest.raises(UnknownRecipeError):
        load_recipe("nope")
