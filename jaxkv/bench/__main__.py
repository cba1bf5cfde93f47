"""``python -m jaxkv.bench NAME ...`` = ``jaxkv bench NAME ...``."""

import sys

from jaxkv.bench.cli import main

sys.exit(main(sys.argv[1:]))
