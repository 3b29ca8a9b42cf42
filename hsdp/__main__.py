import sys

from hsdp.cli import main

sys.exit(main())
