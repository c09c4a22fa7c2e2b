"""Drivers that run peers' own test suites against gpuring's facades (from the tree, not in CI)."""
