"""Benchmark and trace harness: `specdec bench` and `specdec trace summarize`."""
