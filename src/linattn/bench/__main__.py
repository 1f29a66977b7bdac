"""`python -m linattn.bench NAME ...` is `linattn bench NAME ...`."""
import sys

from . import command_line

if __name__ == "__main__":
    sys.exit(command_line(sys.argv[1:]))
