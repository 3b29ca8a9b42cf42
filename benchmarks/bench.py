"""Entry point kept next to the results: ``python benchmarks/bench.py ...`` is ``hsdp bench ...``."""

import sys

from hsdp.tools.bench.driver import main

if __name__ == "__main__":
    sys.exit(main())
