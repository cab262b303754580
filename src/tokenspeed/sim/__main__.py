"""`python -m tokenspeed.sim ...` (see `tokenspeed.sim.cli`)."""

import sys

from tokenspeed.sim.cli import main

sys.exit(main())
