"""``python -m kvledger`` is the ``kvledger`` command."""

import sys

from kvledger.replay.cli import main

sys.exit(main())
