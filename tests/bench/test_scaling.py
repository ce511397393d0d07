"""`python -m bench.scaling`: each (method, size) trained once, resumed from disk or from the results JSON, the size
caps per method."""

from __future__ import annotations

import json
import shutil

import pytest

from bench.scaling import ScalingConfig, kept_rows, main
from heads.cli import parse_flags
from tests.tiny_models import STORIES260K


def test_scaling_command_trains_each_size_once_and_resumes(stories_dataset, tmp_path):
    recipe = tmp_path / "eagle_tiny.yaml"
    recipe.write_text(f"method: eagle\nmodel: {STORIES260K}\nper_device_batch_size: 2\n"
                      "learning_rate: 0.003\neval_depth: 2\nlogging_steps: 1\n")
    flags = ["--dataset", str(stories_dataset), "--eval_dataset", str(stories_dataset), "--methods", "eagle",
             "--recipes", str(tmp_path / "{method}_tiny.yaml"), "--token_sizes", "200,600", "--eval_samples", "4",
             "--output_dir", str(tmp_path / "runs"), "--results_json", str(tmp_path / "scaling.json"),
             "--plot", str(tmp_path / "scaling.png")]
    runs = main(flags)
    assert [r["requested_tokens"] for r in runs] == [200, 600]
    assert runs[0]["steps"] < runs[1]["steps"]  # same epochs: steps grow with the data
    assert runs[0]["epochs"] == 1 and runs[0]["learning_rate"] == 0.003
    assert json.loads((tmp_path / "scaling.json").read_text())["runs"] == runs
    assert (tmp_path / "scaling.png").stat().st_size > 0
    mtime = (tmp_path / "runs" / "eagle_200" / "metrics.jsonl").stat().st_mtime
    assert main(flags) == runs  # finished runs are read back, not trained again
    assert (tmp_path / "runs" / "eagle_200" / "metrics.jsonl").stat().st_mtime == mtime
    # a finished run of another recipe held out on the same set joins the results with its own dataset named
    extra = main(flags + ["--extra_runs", f"eagle={tmp_path / 'runs' / 'eagle_600'}"])
    assert extra[:2] == runs and len(extra) == 3
    assert extra[2]["train_tokens"] == runs[1]["train_tokens"] and extra[2]["dataset"] == str(stories_dataset)
    assert json.loads((tmp_path / "scaling.json").read_text())["runs"] == extra
    other_eval = [tmp_path / "other" if f == str(stories_dataset) and i == 3 else f for i, f in enumerate(flags)]
    with pytest.raises(ValueError, match="--extra_runs: .* held out on"):
        main([str(f) for f in other_eval] + ["--extra_runs", f"eagle={tmp_path / 'runs' / 'eagle_600'}"])
    with pytest.raises(FileNotFoundError, match="--extra_runs: .*no finished"):
        main(flags + ["--extra_runs", f"eagle={tmp_path / 'nowhere'}"])
    # a fresh checkout: the run directories are gone, the results JSON is not; rows are kept, nothing retrains
    shutil.rmtree(tmp_path / "runs")
    assert main(flags + ["--extra_runs", f"eagle={tmp_path / 'runs' / 'eagle_600'}"]) == extra
    assert not (tmp_path / "runs" / "eagle_200").exists()
    config = parse_flags(ScalingConfig, flags + ["--extra_runs", f"eagle={tmp_path / 'runs' / 'eagle_600'}"])
    assert sorted(kept_rows(config)) == [("curve", str(tmp_path / "runs" / f"eagle_{n}")) for n in (200, 600)] + [
        ("extra", str(tmp_path / "runs" / "eagle_600"))]
    changed = parse_flags(ScalingConfig, flags + ["--extra_flags", "--learning_rate 1e-2"])
    # another recipe flag: the curve's rows are not this config's; the extra run (its own recipe) still is
    assert list(kept_rows(changed)) == [("extra", str(tmp_path / "runs" / "eagle_600"))]
    assert kept_rows(parse_flags(ScalingConfig, flags + ["--keep_results", "false"])) == {}


def test_size_caps_apply_to_the_methods_run_and_unknown_methods_are_errors(tmp_path):
    for method in ("eagle", "medusa"):
        (tmp_path / f"{method}_r.yaml").write_text(f"method: {method}\n")
    common = {"dataset": "d", "eval_dataset": "e", "recipes": str(tmp_path / "{method}_r.yaml"),
              "token_sizes": "10,20,30"}
    args = ScalingConfig(methods="eagle,medusa", max_tokens="medusa=20,eagle3=10", **common)
    assert args.runs() == [("eagle", 10, 1), ("medusa", 10, 1), ("eagle", 20, 1), ("medusa", 20, 1), ("eagle", 30, 1)]
    assert ScalingConfig(methods="eagle", max_tokens="medusa=20", **common).runs() == [
        ("eagle", 10, 1), ("eagle", 20, 1), ("eagle", 30, 1)]
    # a size x epochs grid: the further epochs only up to their size cap, each run in a directory of its own
    grid = ScalingConfig(methods="eagle", more_epochs="2,4", more_epochs_max_tokens=20, **common)
    assert grid.runs() == [("eagle", 10, 1), ("eagle", 10, 2), ("eagle", 10, 4), ("eagle", 20, 1), ("eagle", 20, 2),
                           ("eagle", 20, 4), ("eagle", 30, 1)]
    assert [grid.run_dir("eagle", 10, e).name for e in (1, 2)] == ["eagle_10", "eagle_10_e2"]
    with pytest.raises(ValueError, match="--more_epochs"):
        ScalingConfig(methods="eagle", more_epochs="two", **common)
    with pytest.raises(ValueError, match="--more_epochs"):
        ScalingConfig(methods="eagle", more_epochs="0", **common)
    with pytest.raises(ValueError, match="--max_tokens: expected METHOD=TOKENS"):
        ScalingConfig(methods="eagle", max_tokens="eagel=20", **common)


def test_size_by_epochs_grid_trains_each_cell_with_its_own_schedule(stories_dataset, tmp_path):
    recipe = tmp_path / "eagle_tiny.yaml"
    recipe.write_text(f"method: eagle\nmodel: {STORIES260K}\nper_device_batch_size: 2\neval_depth: 2\n")
    runs = main(["--dataset", str(stories_dataset), "--eval_dataset", str(stories_dataset), "--methods", "eagle",
                 "--recipes", str(tmp_path / "{method}_tiny.yaml"), "--token_sizes", "200,400", "--eval_samples", "4",
                 "--more_epochs", "2", "--more_epochs_max_tokens", "200", "--output_dir", str(tmp_path / "runs"),
                 "--results_json", str(tmp_path / "grid.json"), "--plot", str(tmp_path / "grid.png")])
    assert [(r["requested_tokens"], r["epochs"]) for r in runs] == [(200, 1), (200, 2), (400, 1)]
    assert runs[1]["steps"] == 2 * runs[0]["steps"] and runs[1]["train_tokens"] == runs[0]["train_tokens"]
    assert (tmp_path / "runs" / "eagle_200_e2" / "metrics.jsonl").is_file()
    assert (tmp_path / "grid.png").stat().st_size > 0
