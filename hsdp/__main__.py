import sys

from hsdp.apps.cli import main

sys.exit(main())
