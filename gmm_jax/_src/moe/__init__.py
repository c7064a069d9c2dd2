"""Mixture-of-experts on the gmm op: token routing and its transports, the routed experts' FFN, and the routed experts as one partitionable op with its layouts."""
