"""Microbenchmarks: run as modules from the checkout, e.g. ``python -m bench.kernels``."""
