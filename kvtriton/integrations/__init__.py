"""Adapters that plug kvtriton into serving engines (optional extras)."""
