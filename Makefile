# The two commands of the README: `make train` and `make test`. Both set up .venv/ first if needed.
PY      := .venv/bin/python
VENV_OK := .venv/.installed
# The CPU build of torch, so a machine without a GPU does not download a multi-GB CUDA build.
CPU_TORCH := torch==2.13.0

.PHONY: install train test test-fast lint format docs clean

install: $(VENV_OK)

$(VENV_OK): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	@# Keep a CUDA torch that is already there; otherwise take the CPU build unless a GPU is visible.
	if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	  else $(PY) -m pip install -q $(CPU_TORCH); fi; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	touch $(VENV_OK)

# The demo starts from scratch each time, then scores exact-match answers on the held-out questions.
train: install
	rm -rf runs/quickstart
	$(PY) scripts/finetune.py --recipe recipes/quickstart.yaml $(ARGS)
	$(PY) scripts/eval_accuracy.py --model runs/quickstart/final --data assets/quickstart/eval.jsonl

test: install
	$(PY) -m pytest -q $(ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow and not multiprocess" $(ARGS)

lint: install
	$(PY) -m ruff check llmtune scripts tests
	$(PY) -m ruff format --check llmtune scripts tests

format: install
	$(PY) -m ruff format llmtune scripts tests
	$(PY) -m ruff check --fix llmtune scripts tests

clean:
	rm -rf .venv runs .pytest_cache .ruff_cache *.egg-info

docs: install
	$(PY) -c "import re, pathlib; from llmtune.recipe import reference; p = pathlib.Path('docs/recipes.md'); \
	t = p.read_text(); p.write_text(t[: t.index('| key |')] + reference())"
	.venv/bin/llmtune schema > docs/recipe.schema.json
