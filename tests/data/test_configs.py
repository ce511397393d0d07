"""The data recipes in configs/: each parses with the flags of the command its first line names (unknown keys
are errors there), so a recipe cannot silently drift from its CLI."""

from pathlib import Path

import pytest

from data.distill import DistillConfig
from data.hidden_states import HiddenStatesConfig
from data.runfiles import parse_config
from data.task_prompts import TaskPromptsConfig

REPO = Path(__file__).resolve().parents[2]
COMMANDS = {"distill": ("-m data.distill", DistillConfig), "data": ("-m data.distill", DistillConfig),
            "features": ("-m data.hidden_states", HiddenStatesConfig),
            "prompts": ("-m data.task_prompts", TaskPromptsConfig)}
RECIPES = sorted(p for p in (REPO / "configs").glob("*.yaml") if p.stem.split("_")[0] in COMMANDS)


def test_there_are_data_recipes():
    assert {p.stem.split("_")[0] for p in RECIPES} == set(COMMANDS)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_data_recipe_parses_with_its_command(recipe: Path):
    command, cls = COMMANDS[recipe.stem.split("_")[0]]
    first = recipe.read_text().splitlines()[0]
    assert first.startswith("# ") and command in first and f"configs/{recipe.name}" in first
    config = parse_config(cls, ["--config", str(recipe)])
    assert (config.text and config.output) if cls is TaskPromptsConfig else (config.model and config.output_dir)


def test_unknown_key_in_a_data_recipe_is_refused(tmp_path):
    recipe = tmp_path / "distill_bad.yaml"
    recipe.write_text("model: m\noutput_dir: o\nprompts: p\nmax_promts: 3\n")
    with pytest.raises(ValueError, match="max_promts"):
        parse_config(DistillConfig, ["--config", str(recipe)])
