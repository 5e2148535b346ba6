"""Benchmarks of the scheduling engine; see bench/README.md. Not part of the installed package."""
