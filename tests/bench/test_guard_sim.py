"""`python -m bench.guard_sim`: the guard played on seeded answers, with and without the ledger's loss cap."""

from __future__ import annotations

import json

from bench.guard_sim import main


def test_the_cap_keeps_every_simulated_answer_within_five_percent_of_plain(tmp_path):
    rows = main(["--answers", "20", "--output_json", str(tmp_path / "sim.json")])
    assert len(rows) == 7 and json.loads((tmp_path / "sim.json").read_text())["cases"] == rows
    assert all(r["capped_worst"] >= 0.95 for r in rows)
    assert min(r["uncapped_worst"] for r in rows) < 0.95  # without the cap some answer loses more
    paying = [r for r in rows if r["forced_mean"] > 1.1]
    assert paying and all(r["capped_mean"] >= 0.97 * r["forced_mean"] for r in paying)
