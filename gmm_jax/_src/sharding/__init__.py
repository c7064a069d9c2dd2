"""How a gmm splits over a mesh: the plans (which axes split m, k, n and groups) and the explicit, shard_map form."""
