"""kvtriton inside vLLM 0.33 and in front of Mooncake Store (optional extras).

``kvtriton.integrations.vllm`` is the ``spec_module_path`` vLLM's
OffloadingConnector loads; ``kvtriton.integrations.mooncake`` is the
``module_path`` of the Mooncake Store secondary tier. Importing this package
imports neither vLLM nor Mooncake.
"""

# The public surface here is the two entry modules above, which vLLM loads by path; the package itself
# exports nothing, so that importing it never imports either of them.
__all__: list[str] = []
