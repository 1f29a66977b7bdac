"""Tests of the experiments (src/linattn/experiments/)."""
