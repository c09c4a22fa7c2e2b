"""cupyx.scipy on the CUDA simulator: `sparse` only."""
