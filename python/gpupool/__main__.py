"""Lets ``python -m gpupool`` run the command-line interface."""

from gpupool.cli import main

raise SystemExit(main())
