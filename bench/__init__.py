"""Benchmarks across prompt kinds: `python -m bench.prompt_kinds` builds the prompt sets, `python -m bench.kinds`
runs `runtime.bench_heads` once per kind and aggregates the results."""
