"""Placeholder until the embedded server lands."""
