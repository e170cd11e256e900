"""kvtriton inside vLLM 0.33 and in front of Mooncake Store (optional extras).

``kvtriton.integrations.vllm`` is the ``spec_module_path`` vLLM's
OffloadingConnector loads; ``kvtriton.integrations.mooncake`` is the
``module_path`` of the Mooncake Store secondary tier. Importing this package
imports neither vLLM nor Mooncake.
"""

# The entry packages above are what vLLM loads by path; the package itself exports what the command line, the
# benchmarks and the entry packages ask of the installed vLLM and Mooncake, which must answer when either is absent
# or broken, and the loopback Mooncake store (MooncakeCluster) the Mooncake benchmark and a trial run on.
from kvtriton.integrations._mooncake_local import (
    MooncakeCluster,
    installed_mooncake_version,
    mooncake_missing,
    mooncake_version_problem,
)
from kvtriton.integrations._vllm_release import (
    ALLOW_UNTESTED_VLLM,
    TESTED_VLLM_RANGE,
    TESTED_VLLM_RELEASES,
    installed_vllm_version,
    tested_releases,
    vllm_missing,
    vllm_release,
)

__all__ = [
    "ALLOW_UNTESTED_VLLM",
    "TESTED_VLLM_RANGE",
    "TESTED_VLLM_RELEASES",
    "MooncakeCluster",
    "installed_mooncake_version",
    "installed_vllm_version",
    "mooncake_missing",
    "mooncake_version_problem",
    "tested_releases",
    "vllm_missing",
    "vllm_release",
]
