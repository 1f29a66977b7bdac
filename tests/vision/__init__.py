"""Tests of linattn.vision (src/linattn/vision/)."""
