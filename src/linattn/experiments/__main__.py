"""`python -m linattn.experiments NAME [options]` is `linattn experiment NAME [options]`."""
import sys

from ..cli import main

sys.exit(main(["experiment", *sys.argv[1:]]))
