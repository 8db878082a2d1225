"""`python -m p2pnet` is the `p2pnet` command."""

import sys

from p2pnet.cli import main

sys.exit(main())
