"""`python -m linattn ...` is the `linattn` command."""
import sys

from .cli import main

sys.exit(main())
