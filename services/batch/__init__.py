"""The offline video batch job (``python -m services.batch``): ``job`` (the command and its driver) and ``pipeline``
(the Ray Data stages over the same ``common/`` stage code as online serving)."""
