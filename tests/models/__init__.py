"""Tests of models (src/linattn/models/)."""
