"""Rectified-flow objective, training timestep distributions, inference schedule, the Euler sampler."""
