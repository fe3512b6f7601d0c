"""Recipes that ship with the package: `quickstart.yaml` is what `vlmrl train` runs without a recipe."""
