"""Every rank's program in a launch of named items: `run_items.py SPEC.json` (harness.py)."""

from harness import main

if __name__ == "__main__":
    main()
