"""Build the real model and dialogues of recipes/smollm2-chat-lora.yaml into llmtune's asset cache (once; later
calls only look), and print the recipe overrides that point at them (`--model`: the model's folder alone):

llmtune train --recipe recipes/smollm2-chat-lora.yaml $(python scripts/build_real_model.py)

The paths are printed rather than written in the recipe because the cache moves with LLMTUNE_ASSETS and
transformers does not expand `~` in a model path.
"""

import json
import sys

from llmtune import assets

# The recipe's own sizes: its data paths name them (chitchat-2000-64).
N_TRAIN, N_EVAL = 2000, 64


def overrides() -> list[str]:
    model = assets.smollm2()
    train, eval_ = assets.chitchat(N_TRAIN, N_EVAL)

    def source(path: object) -> str:  # JSON is YAML; compact, so the shell keeps each override one word
        return json.dumps([{"path": str(path), "format": "messages"}], separators=(",", ":"))

    return [f"model.name_or_path={model}", f"data.train={source(train)}", f"data.eval={source(eval_)}"]


if __name__ == "__main__":
    args = [str(assets.smollm2())] if sys.argv[1:] == ["--model"] else overrides()
    if any(len(arg.split()) > 1 for arg in args):  # $(...) would split it
        sys.exit(f"the asset cache {assets.cache_dir()} has a space in its path: set LLMTUNE_ASSETS to one without")
    print(" ".join(args))
