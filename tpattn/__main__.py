"""``python -m tpattn``: see ``tpattn.cli``."""
import sys

from tpattn.cli import main

sys.exit(main(prog="python -m tpattn"))
