"""Developer tools of the gpuring repository, run from the source tree (the repository root on
PYTHONPATH, or as the working directory of `python -m`); not part of the installed library,
which never imports them."""
