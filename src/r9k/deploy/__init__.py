"""r9k.deploy: the Ray fleet (fleet file, placement, replica supervisor, health, entry point)."""
