"""``python -m kvledger.replay`` is ``kvledger``."""

import sys

from kvledger.replay.cli import main

sys.exit(main())
