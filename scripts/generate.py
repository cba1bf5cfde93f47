"""The demo behind `make demo`: text from the embedded model, its speed, and its KV memory
(paged pages reserved vs a contiguous max-length reservation).

    python scripts/generate.py [--max-tokens 64] [--model PATH] [--prompt TEXT ...]
"""

import sys

from jaxkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["generate", *sys.argv[1:]]))
