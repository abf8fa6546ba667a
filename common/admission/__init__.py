"""Admission: every decision to let a request use a stage's capacity, or to refuse it, in one place."""
