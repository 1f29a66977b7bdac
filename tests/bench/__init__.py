"""Tests of the benchmarks (src/linattn/bench/)."""
