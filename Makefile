# Two commands set everything up on a fresh machine: `make reports` and `make test`.
PY      ?= .venv/bin/python
DEVICE  ?= cpu
DTYPE   ?= $(if $(filter cuda,$(DEVICE)),bfloat16,float32)
MODELS  ?= tiny-qwen3 tiny-qwen2 tiny-qwen3_5
MODEL   ?= tiny-qwen3
# make test's pytest-xdist workers: the CI machine's two cores (0: one process; 15 minutes there against 23)
TEST_WORKERS ?= 2
ONE_OR_ALL = $(if $(filter command line,$(origin MODEL)),$(MODEL),$(MODELS))
export PYTHONUNBUFFERED := 1
# on the CPU our Triton kernels (the batch-invariant mode, test-kernels) run in Triton's interpreter
export TRITON_INTERPRET := $(if $(filter cuda,$(DEVICE)),0,1)

.PHONY: lint test test-kernels fuzz reports baseline lab bench clean

# pocketlab (editable) with every extra of pyproject.toml, at the versions requirements.txt pins
.venv/.installed: requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q -r requirements.txt
	touch $@

lint: .venv/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) tests
	$(PY) -m pytest -p no:cacheprovider --nbval-lax notebooks/

# every engine test once more through our Triton kernels (fused linear included), run by Triton's CPU interpreter
# (over 25 minutes on a 2-core machine)
test-kernels: .venv/.installed
	POCKETLAB_KERNELS=triton TRITON_INTERPRET=1 $(PY) -m pytest -q tests/test_fused_linear.py tests/test_decode_attention.py \
		tests/test_linear_decode.py tests/test_slots.py tests/test_snapshot.py tests/test_prefix_cache.py \
		tests/test_parity.py tests/test_errors.py tests/test_generate.py tests/test_graphs.py tests/test_moe.py
	POCKETLAB_KERNELS=triton TRITON_INTERPRET=1 $(PY) -m pytest -q tests/test_speculative.py -k "rolled_back or half or graphed"

# FUZZ_SCHEDULES random call schedules (make test runs 100 fixed ones) from FUZZ_SEED, printed so a run can be repeated;
# a failure is shrunk to a minimal schedule and kept in .hypothesis/ (tried first next time). Then the interrupt and
# hostile-file tests; their counts go to reports/reliability.json, the README's table to reports/reliability.md
FUZZ_SCHEDULES ?= 1000
FUZZ_SEED ?= $(shell date +%s)
fuzz: .venv/.installed
	rm -f reports/reliability.json
	@echo "fuzz seed $(FUZZ_SEED) (repeat: make fuzz FUZZ_SEED=$(FUZZ_SEED))"
	POCKETLAB_RELIABILITY=reports/reliability.json POCKETLAB_FUZZ_SCHEDULES=$(FUZZ_SCHEDULES) $(PY) -m pytest -q -s \
		--hypothesis-seed=$(FUZZ_SEED) --hypothesis-show-statistics \
		tests/test_fuzz.py tests/test_interrupts.py tests/test_hostile_files.py
	$(PY) -m pocketlab.verify.fuzz --table reports/reliability.json --seed $(FUZZ_SEED) | tee reports/reliability.md

reports: .venv/.installed
	$(PY) -m pocketlab.verify.reports --device $(DEVICE) --dtype $(DTYPE) \
		--models $(ONE_OR_ALL) $(if $(NOTEBOOKS),--only $(NOTEBOOKS)) $(foreach p,$(PARAMS),-p $(p))

baseline: .venv/.installed
	for m in $(ONE_OR_ALL); do \
		$(PY) -m pocketlab.verify.perf --write-baseline --device $(DEVICE) --dtype $(DTYPE) --model $$m || exit 1; done

bench: .venv/.installed
	$(PY) -m pocketlab.tools.bench --model $(MODEL)

lab: .venv/.installed
	$(PY) -m pip install -q jupyterlab
	$(PY) -m jupyter lab notebooks/

clean:
	rm -rf .venv checkpoints .pytest_cache
