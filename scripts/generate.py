"""The demo behind `make demo`: text from the embedded model, its speed and its KV memory
(paged pages reserved vs a contiguous max-length reservation), then a multi-turn chat whose
later turns are served from the prefix cache.

    python scripts/generate.py [--max-tokens 64] [--model PATH] [--prompt TEXT ...]
"""

import sys

from jaxkv.cli import main

if __name__ == "__main__":
    code = main(["generate", *sys.argv[1:]])
    if code == 0 and len(sys.argv) == 1:
        print("\n" + "=" * 72 + "\n")
        code = main(["chat"])
    sys.exit(code)
