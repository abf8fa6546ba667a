"""Typed objects that cross stage boundaries, and their pickle-free wire encoding."""
