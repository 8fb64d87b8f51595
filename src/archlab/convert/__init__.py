"""Checkpoint conversion: Hugging Face Llama import (``hf``) and the identity-preserving
delta-MHAR conversion of a standard-residual model (``delta``)."""
