"""Rectified-flow objective, timestep samplers, inference schedule (and, later, the sampler)."""
