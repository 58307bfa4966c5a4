"""shardkit: write the model once with logical axis names, pick a recipe, train on any mesh."""

__version__ = "0.1.0"
