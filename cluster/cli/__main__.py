"""``python -m cluster.cli ...``: the ``duet`` command."""

import sys

from cluster.cli.main import main

sys.exit(main())
