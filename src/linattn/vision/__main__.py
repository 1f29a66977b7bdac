"""`python -m linattn.vision ACTION ...`: the same as `linattn vision ACTION ...`."""
import sys

from ..cli_support import UsageError, report_error
from .commands import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    try:
        sys.exit(main(argv[0] if argv else None, argv[1:]))
    except UsageError as e:
        sys.exit(report_error(str(e), e.prog))
