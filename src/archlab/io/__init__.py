"""Input/output shared by training, evaluation, inference and conversion: checkpoints
(``checkpoint``: safetensors plus JSON state, atomic, verified) and devices (``device``)."""
