"""Tests of the transformers integration and the fla import (src/linattn/hf/)."""
