"""Placeholder package; filled by its own issue."""
