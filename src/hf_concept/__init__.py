"""hf_concept: concept-level and multi-stream language models for the Hugging Face stack."""

__version__ = "0.1.0"
