"""The numpy API and what the adapters share: collectives, grouped ops, objects, gradient
maths, elastic state."""
