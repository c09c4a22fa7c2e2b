"""Runs of peers' own test suites against gpuring's facades (from the tree, not CI)."""
