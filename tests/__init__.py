"""The test suite, a package (tests/<folder>/ mirrors src/linattn/<folder>/): two test modules in different
folders may share a basename, and shared code is imported as `from tests.helpers import ...`."""
