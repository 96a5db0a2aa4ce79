"""Train from a recipe. Thin entry point; the logic lives in llmtune.run.loop.

accelerate launch scripts/finetune.py --recipe recipes/quickstart.yaml [key.sub=value ...]
python scripts/finetune.py --recipe recipes/quickstart.yaml   # one process
"""

import sys

from llmtune.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
