"""Builders for the vLLM adapter tests: vLLM configs, canonical KV caches, requests.

Import only after ``pytest.importorskip("vllm")``: this package imports vLLM.
"""
