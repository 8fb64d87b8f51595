"""The model: one configurable decoder (``transformer.Transformer``) and its accounting."""

from archlab.model.transformer import ModelOutput, Transformer


def build_model(cfg) -> Transformer:
    return Transformer(cfg)


__all__ = ["ModelOutput", "Transformer", "build_model"]
