"""Tests of the compiled CPU kernels (src/linattn/cpu/)."""
