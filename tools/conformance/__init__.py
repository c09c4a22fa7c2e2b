"""Drivers that run peers' own test suites against gpuring (run from the tree, not in CI)."""
