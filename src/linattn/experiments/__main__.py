"""`python -m linattn.experiments NAME [options]` is `linattn experiment NAME [options]`."""
import sys

from . import command_line

if __name__ == "__main__":
    sys.exit(command_line(sys.argv[1:]))
