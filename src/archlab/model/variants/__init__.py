"""Built-in variants, one package each. A package's ``__init__`` holds the variant's options
dataclass and its ``registry.register`` call and imports no torch; its ``module`` holds the code.
``archlab.model.registry.discover`` imports every package here."""
