"""One-question experiments (ablations, probes, timelines), apart from the benchmark suite;
their findings are recorded in docs/performance.md."""
