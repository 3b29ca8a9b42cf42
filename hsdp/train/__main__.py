"""``python -m hsdp.train``: what every rank runs (and, outside torchrun, the same as ``hsdp train``)."""

import sys

from hsdp.train.command import main

sys.exit(main())
