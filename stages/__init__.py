"""Pipeline stages: one small Typer command each, wired into the `kmoss` app in cli.py."""
