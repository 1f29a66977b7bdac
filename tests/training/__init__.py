"""Tests of training (src/linattn/training/)."""
