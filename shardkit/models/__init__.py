"""Reference models, written once with logical axis names; installed with the package, loaded by name through
`shardkit.registry` (`llama`, `mlp`, `moe`)."""
