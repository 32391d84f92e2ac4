"""``python -m engine``: see ``engine.run.cli``."""

import sys

from engine.run.cli import main

sys.exit(main(prog="python -m engine"))
