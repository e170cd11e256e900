"""Emulate the GPU machine's package set in this process (``bench/gpu_check.sh --dry-run`` puts this folder on
``PYTHONPATH``; bench/gpu_machine_imports.py says what is allowed)."""

from bench.gpu_machine_imports import install

install()
