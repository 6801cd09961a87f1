"""Everything a checkpoint loads: flat sibling modules, imported only with `from .sibling import …`.

This `__init__` is not copied into checkpoints; the modules must not import anything else from
`hf_concept` (DESIGN §2).
"""
