"""Entry point kept next to the results: ``python benchmarks/bench.py ...`` is ``hsdp bench ...``."""

import sys

from hsdp.apps.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
