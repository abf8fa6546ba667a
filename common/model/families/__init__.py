"""Model family adapters (one module per transformers architecture); see ``base.py`` for the contract."""
