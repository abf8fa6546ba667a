"""Content-addressed caches (processor outputs, encoder outputs), bounded by bytes and scoped by tenant."""
