"""``python -m hsdp.apps.train``: what every rank runs (and, outside torchrun, the same as ``hsdp train``)."""

import sys

from hsdp.apps.train.command import main

sys.exit(main())
