"""Model side of Prism: family adapters, the embedded-model builder, the model contract and the loader."""
