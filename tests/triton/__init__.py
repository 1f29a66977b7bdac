"""Tests of the Triton kernels (src/linattn/triton/)."""
