"""``python -m rpcdist.launch``: the same as ``rpcdist-run``."""

import sys

from . import main

sys.exit(main())
