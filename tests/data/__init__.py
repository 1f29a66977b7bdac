"""Tests of data preparation (src/linattn/data/)."""
