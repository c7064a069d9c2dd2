"""Mixture-of-experts on the gmm op: token routing and its transports, and the routed experts as one partitionable op."""
