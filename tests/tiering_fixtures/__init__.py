"""A vLLM engine stepped by hand on CPU with kvtriton as the primary tier of vLLM's tiered offloading.

Import only after ``pytest.importorskip("vllm")``: this package imports vLLM.
"""
