#!/usr/bin/env bash
# Wheels and fixtures for the lent GPU machine (no network there; its python3 already has torch, numpy, scipy, sentencepiece,
# tokenizers, safetensors, imageio, matplotlib, tensorboard, psutil, tqdm, pytest, msgpack). Run HERE, in the repo
# root, before the device call; the wheels land in .whl/ (git-ignored) and travel with `carry: [".whl"]`:
#
#   bash bench/gpu_wheels.sh
#   # device run, carry [".whl", ".shared"]:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && \
#     export PYTHONPATH=/tmp/site PI0_SHARED=$PWD/.shared && python3 bench/gpu_suite.py --out $OUT/suite
#
# .shared/ is a copy of the ../shared fixtures the CUDA tests read (../shared does not travel with the repo).
#
# Only pure-Python packages at the versions requirements.lock pins (py3-none-any wheels run on the machine's 3.12).
# The LIBERO simulator (GBs of assets) does not fit the 64 MiB the tool carries: the suite then uses the arena.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.shared/' .git/info/exclude 2>/dev/null || echo '/.shared/' >> .git/info/exclude
mkdir -p .shared/golden
cp -r ../shared/golden/openpi_pi0_tiny ../shared/golden/openpi_libero_policy_tiny ../shared/golden/openpi_pi05_tiny \
   ../shared/golden/openpi_pi05_libero_policy_tiny .shared/golden/
pins=$(grep -iE '^(omegaconf|gymnasium|farama-notifications)==' requirements.lock)
python3 -m pip wheel -q --no-deps -w .whl $pins
ls -la .whl
