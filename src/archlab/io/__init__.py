"""Input/output shared by training, evaluation, inference and conversion: checkpoints
(``checkpoint``: safetensors plus JSON state, atomic, verified; ``dcp``: the sharded format of
distributed runs), devices (``device``), file digests (``files``) and temporaries' names
(``temporaries``). It imports none of its consumers (train, eval, infer, convert, data, lab)."""
