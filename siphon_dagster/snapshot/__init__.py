"""Exact snapshots of block ranges, read under a snapshot exported by a temporary logical slot."""
