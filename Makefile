# The only two setup commands: `make run` and `make test`. Both create/refresh a project-local
# .venv from the pinned requirements.lock (torch 2.13.0 CPU from the local wheel), install the
# Mesa libraries that headless MuJoCo rendering needs, then do their job.
PY      ?= python3.11
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
SYSSTAMP := $(VENV)/.system-deps
MESA_PKGS := libegl1 libegl-mesa0 libgl1-mesa-dri libosmesa6
export MUJOCO_GL ?= egl
export PYOPENGL_PLATFORM ?= egl

.PHONY: install run test bench clean system-deps openpi-venv sim-venv

install: $(STAMP) $(SYSSTAMP)

$(VENV)/bin/python:
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

$(STAMP): requirements.lock pyproject.toml | $(VENV)/bin/python
	grep -v '^openpi-client==\|^metaworld==' requirements.lock > $(VENV)/.requirements-deps.txt
	$(VPY) -m pip install -q -r $(VENV)/.requirements-deps.txt
	$(VPY) -m pip install -q --no-deps $$(grep '^openpi-client==' requirements.lock)  # declares numpy<2; runs on 2
	$(VPY) -m pip install -q --no-deps $$(grep '^metaworld==' requirements.lock)  # declares mujoco 3.3.0; runs on 3.2.3
	$(VPY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

# Mesa for headless MuJoCo (EGL / OSMesa). Only calls apt-get when something is missing.
$(SYSSTAMP): | $(VENV)/bin/python
	@missing=""; for p in $(MESA_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "apt-get install$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi
	touch $@

# The main job: stage 11's default preset trains a converged tiny pi0 start on the arena, then RL and continued SFT
# side by side (CPU, about 14 minutes on 2 cores) -> runs/stage11_ript_vla/ (success.png, summary.json, TensorBoard,
# videos, checkpoints, config.yaml). Overrides: RUN_ARGS="k=v ..."
run: install
	$(VPY) 11_train_ript_vla_style.py $(RUN_ARGS)

test: install
	$(VPY) -m pytest -q -ra --durations=25 tests

bench: install
	$(VPY) bench/sampling.py

# Simulator-only venvs for bench/sim_stack_divergence.py, from their own lock (no torch): `make openpi-venv` is
# openpi's LIBERO stack (mujoco 3.2.3) in .venv-openpi; `make sim-venv MUJOCO=3.17.0` the same with another mujoco
# (in .venv-mujoco-3.17.0), to show the divergence of an unpinned stack.
SIM_LOCK := requirements-openpi-sim.lock
MUJOCO   ?= 3.2.3
SIM_VENV ?= $(if $(filter 3.2.3,$(MUJOCO)),.venv-openpi,.venv-mujoco-$(MUJOCO))

openpi-venv:
	$(MAKE) sim-venv MUJOCO=3.2.3

sim-venv: $(SIM_VENV)/.installed-$(MUJOCO)

$(SIM_VENV)/.installed-$(MUJOCO): $(SIM_LOCK)
	test -x $(SIM_VENV)/bin/python || $(PY) -m venv $(SIM_VENV)
	sed 's/^mujoco==.*/mujoco==$(MUJOCO)/' $(SIM_LOCK) > $(SIM_VENV)/requirements.lock
	$(SIM_VENV)/bin/python -m pip install -q -r $(SIM_VENV)/requirements.lock
	$(SIM_VENV)/bin/python -c "import mujoco, robosuite, libero.libero; print('mujoco', mujoco.__version__)"
	touch $@

clean:
	rm -rf $(VENV) .venv-openpi .venv-mujoco-* .pytest_cache
