"""`python -m linattn.bench NAME ...` is `linattn bench NAME ...`."""
import sys

from ..cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
