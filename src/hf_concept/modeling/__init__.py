"""Everything a checkpoint loads: flat sibling modules, imported only with `from .sibling import …`.

This `__init__` is not copied into checkpoints; the modules must not import anything else from
`hf_concept`, since a shared checkpoint carries them without the package.

A module's name says who ships it: `concept_*` the two concept families (ConceptMoE and DLCM), `dlcm_*`,
`hidden_decoding_*` and `lslm_*` one family (with each family's `configuration_*` and `modeling_*`), and a
module without a family prefix is shared by several (`layers`, `pooling`, `routing`, ...; `*_plain` is the
backbone every family builds on). Each family's exact list is pinned by tests/test_remote_code_files.py.
"""
