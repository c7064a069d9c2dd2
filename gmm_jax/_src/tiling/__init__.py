"""The tiles of a gmm: the kernels' cost models and chip facts, the tile tables, the heuristics' choice, the autotuner."""
