"""GDN spec-decode kernel benchmark on a GPU (stock per-slot vs one-page fused vs composed):
`lab.gdn_kernel`, where the static-analysis script and the interpreter tests import it
from. `python -m lab.scripts.gdn_kernel --help`."""
import sys

from lab.gdn_kernel import main

if __name__ == "__main__":
    sys.exit(main())
