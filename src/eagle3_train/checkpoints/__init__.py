"""How a draft is stored and read: every on-disk contract of a draft lives in this package.

- `native.py`: our checkpoints and training run directories (what `train` writes; `resolve_checkpoint` turns a run
  directory or checkpoint path into the checkpoint, for export, evaluate, serve and finetune alike; the verifier a
  draft records).
- `formats.py`: reading a draft in any published layout (ours, EAGLE/SpecForge/SGLang, speculators).
- `layouts.py`: the config.json and tensor names the engines read (what `export` writes).
- `fit.py`: the draft-vs-verifier check (hidden size, vocabulary, aux layers).
"""
