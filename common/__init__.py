"""Prism's Ray-free core. Importing anything under ``common`` never imports ray; all of it runs on CPU in-process."""
