"""Tests of layers (src/linattn/layers/)."""
