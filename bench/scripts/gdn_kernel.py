"""GDN spec-decode kernel benchmark on a GPU (stock per-slot vs one-page fused vs composed):
`r9k.bench.gdn_kernel`, where the static-analysis script and the interpreter tests import it
from. `python bench/scripts/gdn_kernel.py --help`."""
import sys

from r9k.bench.gdn_kernel import main

if __name__ == "__main__":
    sys.exit(main())
