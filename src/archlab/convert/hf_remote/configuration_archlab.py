"""The configuration of an archlab model exported for transformers' remote code.

Copied verbatim into an export folder by ``archlab export-hf`` and loaded from there by
``AutoConfig.from_pretrained(folder, trust_remote_code=True)``: it imports transformers alone,
never archlab, so a user without archlab can load the model.

``layout`` is the model resolved to plain numbers by the exporter (each layer's width and heads,
the order the layers run in, which norm, FFN and channel the model uses); ``modeling_archlab``
builds the network from it without knowing any of archlab's option names or rules.
``archlab_model`` is archlab's own ``model`` config section, kept for ``archlab import-hf``.
"""

from transformers import PretrainedConfig


class ArchlabConfig(PretrainedConfig):
    model_type = "archlab"

    def __init__(self, vocab_size: int = 256, hidden_size: int = 64, num_hidden_layers: int = 1,
                 max_position_embeddings: int = 2048, layout: dict | None = None,
                 archlab_model: dict | None = None, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.max_position_embeddings = max_position_embeddings
        self.layout = layout or {}
        self.archlab_model = archlab_model or {}
        # The model ties its head itself (the checkpoint stores the table once); transformers'
        # own tying must not add or remove a tensor.
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)
