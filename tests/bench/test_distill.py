"""`python -m bench.distill`: every distillation engine on one job (hf and a real HTTP server here), its throughput
and its answers against hf's."""

import json

from bench.distill import main
from tests.data.conftest import prompts  # noqa: F401  (a fixture)
from tests.data.test_distill_engines import serve, target  # noqa: F401  (target: a fixture)
from tests.tiny_models import STORIES260K


def test_bench_runs_every_engine_on_one_job(prompts, target, tmp_path):  # noqa: F811  (the fixtures)
    output = tmp_path / "bench.json"
    with serve(target) as server:
        report = main(["--model", str(STORIES260K), "--prompts", prompts, "--plain_format",
                       "--max_prompts", "3", "--max_new_tokens", "4", "--max_length", "256",
                       "--batch_size", "1", "--engines", "hf,server", "--server_url", server.url,
                       "--output", str(output)])
    assert json.loads(output.read_text()) == report
    hf, served = report["results"]
    assert (hf["engine"], served["engine"]) == ("hf", "server") and served["engine_info"]["version"] == "test-0"
    assert hf["generated_tokens_per_second"] > 0 and served["generated_tokens_per_second"] > 0
    assert served["vs_hf_batch_1"] == {"answers_compared": 4, "identical_answers": 4, "identical_share": 1.0,
                                       "mean_shared_prefix": 1.0, "missing_answers": 0}
