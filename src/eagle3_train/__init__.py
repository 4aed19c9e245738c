"""eagle3-train: train, finetune, export and evaluate EAGLE-3 draft models.

The package layout follows the pipeline:
assets (verifier + data sources) -> data (prepare) -> vocab -> hidden_states (extract) -> model -> train
-> export -> evaluate, with generate (on-policy data) beside data.
"""

__version__ = "0.1.0"
