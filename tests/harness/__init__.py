"""Shared test builders: gloo ranks, models, reference implementations, recipe configs."""
