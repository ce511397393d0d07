"""Config parsing (YAML defaults, CLI overrides, unknown keys) and the recipes in configs/."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.tiny_models import REPO
from training.config import (
    TrainConfig,
    config_differences,
    load_saved_config,
    parse_config,
    read_yaml,
    save_config,
)

RECIPES = sorted(p for p in (REPO / "configs").glob("*.yaml") if p.stem.split("_")[0] in
                 ("medusa", "medusa2", "eagle", "eagle3", "mtp"))
ACCELERATE = sorted((REPO / "configs" / "accelerate").glob("*.yaml"))


def test_yaml_gives_defaults_and_flags_override(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: eagle\nlearning_rate: 0.01\nnum_heads: 2\n")
    config = parse_config(["--config", str(recipe), "--learning_rate", "0.5", "--dataset", "d"])
    assert (config.method, config.learning_rate, config.num_heads, config.dataset) == ("eagle", 0.5, 2, "d")


def test_unknown_yaml_key_is_an_error_naming_it(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: eagle\nlearnin_rate: 0.01\n")
    with pytest.raises(ValueError, match="learnin_rate"):
        parse_config(["--config", str(recipe)])
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        parse_config(["--config", str(tmp_path / "nope.yaml")])
    recipe.write_text("method: eagle\n  - : [\n")  # not YAML: one error naming --config and the file, no traceback
    with pytest.raises(ValueError, match=r"--config .*r\.yaml: not valid YAML \(.*line 2"):
        parse_config(["--config", str(recipe)])


@pytest.mark.parametrize("flags, name", [(["--method", "hydra"], "--method"), (["--report_to", "mlflow"], "--report_to"),
                                         (["--per_device_batch_size", "0"], "--per_device_batch_size"),
                                         (["--eagle3_layers", "1,2"], "--eagle3_layers"),
                                         (["--method", "medusa2", "--features", "x"], "--features")])
def test_invalid_values_name_the_flag(flags, name):
    with pytest.raises(ValueError, match=name):
        parse_config(flags)


def test_saved_config_round_trips_and_differences_ignore_run_length(tmp_path):
    config = parse_config(["--method", "mtp", "--max_steps", "5"])
    save_config(config, tmp_path)
    saved = load_saved_config(tmp_path)
    assert saved == config
    longer = parse_config(["--method", "mtp", "--max_steps", "50", "--report_to", "tensorboard"])
    assert config_differences(saved, longer) == {}
    other = parse_config(["--method", "mtp", "--learning_rate", "0.1"])
    assert set(config_differences(saved, other)) == {"learning_rate"}


def test_recipes_exist_for_every_method_and_model():
    names = {p.stem for p in RECIPES}
    for method in ("medusa", "medusa2", "eagle", "eagle3", "mtp"):
        assert f"{method}_smollm2" in names
    assert {"medusa_llama3_8b", "eagle_llama3_8b", "eagle3_llama3_8b", "eagle3_qwen3_8b"} <= names
    assert {p.stem for p in ACCELERATE} >= {"single_gpu", "ddp_8gpu", "fsdp", "deepspeed_zero2", "cpu_2proc"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_and_starts_with_its_command(recipe: Path):
    first = recipe.read_text().splitlines()[0]
    assert first.startswith("# ") and f"configs/{recipe.name}" in first and "train_heads.py" in first
    values = read_yaml(recipe)
    config = parse_config(["--config", str(recipe)])
    assert isinstance(config, TrainConfig) and config.method == recipe.stem.split("_")[0]
    assert values["method"] == config.method


@pytest.mark.parametrize("recipe", ACCELERATE, ids=lambda p: p.stem)
def test_accelerate_configs_load_and_start_with_a_command(recipe: Path):
    first = recipe.read_text().splitlines()[0]
    assert first.startswith("# accelerate launch") and f"configs/accelerate/{recipe.name}" in first
    values = yaml.safe_load(recipe.read_text())
    assert values["distributed_type"] in ("NO", "MULTI_GPU", "FSDP", "DEEPSPEED")
