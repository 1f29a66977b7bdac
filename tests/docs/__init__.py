"""Tests of the documentation site and the public docstrings (mkdocs.yml, docs/)."""
