"""Draft heads trained for the packaged targets (one folder per target; see README.md there)."""
