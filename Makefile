# Two commands set everything up on a fresh machine: `make reports` and `make test`.
PY      ?= .venv/bin/python
DEVICE  ?= cpu
DTYPE   ?= $(if $(filter cuda,$(DEVICE)),bfloat16,float32)
MODELS  ?= tiny-qwen3 tiny-qwen2 tiny-qwen3_5
MODEL   ?= tiny-qwen3
ONE_OR_ALL = $(if $(filter command line,$(origin MODEL)),$(MODEL),$(MODELS))
export PYTHONUNBUFFERED := 1

.PHONY: test reports baseline lab bench clean

.venv/.installed: requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

test: .venv/.installed
	$(PY) -m pytest tests
	$(PY) -m pytest -p no:cacheprovider --nbval-lax notebooks/

reports: .venv/.installed
	$(PY) -m pocketlab.verify.reports --device $(DEVICE) --dtype $(DTYPE) \
		--models $(ONE_OR_ALL)

baseline: .venv/.installed
	for m in $(ONE_OR_ALL); do \
		$(PY) -m pocketlab.verify.perf --write-baseline --device $(DEVICE) --dtype $(DTYPE) --model $$m || exit 1; done

bench: .venv/.installed
	$(PY) -m pocketlab.bench --model $(MODEL)

lab: .venv/.installed
	$(PY) -m pip install -q jupyterlab
	$(PY) -m jupyter lab notebooks/

clean:
	rm -rf .venv checkpoints .pytest_cache
