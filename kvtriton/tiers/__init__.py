"""Storage tiers behind the host slab (secondary tiers of vLLM's tiered offloading)."""
