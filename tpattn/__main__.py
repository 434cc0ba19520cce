"""``python -m tpattn``: see ``tpattn.cli``."""
import sys

from .cli import main

sys.exit(main(prog="python -m tpattn"))
