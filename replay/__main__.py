"""``python -m replay`` is ``kvledger``."""

import sys

from replay.cli import main

sys.exit(main())
