"""``python -m tools.gpu_check --out DIR``: the driver of ``make gpu-check`` (:mod:`.check`)."""

import sys

from .check import main

sys.exit(main())
