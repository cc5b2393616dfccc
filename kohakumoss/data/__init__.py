"""The data half of the pipeline: sources, catalog, captions, resolution, plan, loader."""
