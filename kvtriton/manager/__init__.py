"""Scheduler side: which blocks live in the host slab, and in which slot."""
