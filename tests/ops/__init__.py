"""Tests of operators (src/linattn/ops/)."""
