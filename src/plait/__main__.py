"""``python -m plait``: the ``plait`` command (see :mod:`plait.cli`)."""

import sys

from plait.cli import main

if __name__ == "__main__":
    sys.exit(main())
