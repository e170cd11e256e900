"""The simulator: what kvtriton's manager would do for a workload, without a GPU.

Workloads and traces, the replay of manager calls, vLLM's call order and a
model of a vLLM server (its scheduler and GPU prefix cache), which
``kvtriton simulate`` and the benchmarks drive. Built on the core only.
"""
