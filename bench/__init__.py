"""Everything that measures, on top of the engine (runtime/, heads/, data/, training/; nothing there imports bench).

Shared: `bench.common` (prompt reading, `load_target` -- the one way a tool builds a target, always through the
load-time verify check --, warm-up and fastest-of-R timing, the environment record) and `bench.report` (JSON
records, markdown tables, plots). One thin command per tool:

    python -m bench.speed          one method against plain decoding and transformers (--batch_sizes: bench.batch)
    python -m bench.drafters       several drafters on the same prompts in one run (--config YAML)
    python -m bench.kinds          bench.drafters once per prompt kind, aggregated (prompt sets: bench.prompt_kinds)
    python -m bench.exactness      greedy identity in a reduced dtype, and where it breaks
    python -m bench.calibration    EAGLE draft confidence vs acceptance
    python -m bench.lookup_replay  cost-aware prompt lookup replayed on fixed answers (no model)
    python -m bench.draft_cost     draft time per step of every head kind, draft-vocabulary coverage
    python -m bench.cost_curve     the verify cost curve of a target on this device
    python -m bench.tree_search    Medusa heads' accuracy table and the sparse tree grown from it
    python -m bench.distill        distillation engines' throughput and agreement
    python -m bench.scaling        data-scaling curve of the training methods
"""
