"""Reference models, written once with logical axis names. Loaded by `shardkit.registry`, not installed."""
