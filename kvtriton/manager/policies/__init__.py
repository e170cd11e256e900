"""Cache policies: one file per policy, chosen by name."""
