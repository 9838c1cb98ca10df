"""Measurement and staging programs: `python -m lab.scripts.NAME --help`."""
