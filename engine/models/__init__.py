"""Model families, one sub-package each (``llava``, ``qwen3_vl``, ``qwen3_5``): a family's config parsing, modules and
checkpoint-key mapping, behind the :class:`engine.config.ModelFamily` protocol its ``family.py`` implements.

The runtime finds a checkpoint's family by ``model_type`` through :mod:`engine.models.registry` and imports it then;
these packages import nothing on import, so the runtime core can use a family's config types (``config.py``) without
loading its modules.
"""
