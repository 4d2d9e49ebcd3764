"""``python -m plait``: the ``plait`` command (see :mod:`plait.train.cli`)."""

import sys

from plait.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
