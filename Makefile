# make run [PROMPT="..."] [ARGS="..."]: set up (once), then generate; make test: set up, then the tests.
# Both go through ./run (VENV= make run: install into the current Python instead of .venv).
PROMPT ?= The capital of France is
ARGS ?= --temperature 0 --max-tokens 20
export PROMPT ARGS

.PHONY: run test
run:
	@./run $$ARGS "$$PROMPT"
test:
	@./run test
