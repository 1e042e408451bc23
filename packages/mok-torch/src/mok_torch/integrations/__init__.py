"""Drop-in integrations of mok with training frameworks.

Each integration lives in its own module and imports its framework only when that module is
imported, so `import mok_torch` never pulls one in:

    from mok_torch.integrations import hf           # Hugging Face transformers v5 (pip install mok-torch[hf])
    from mok_torch.integrations import torchtitan   # torchtitan 0.3.0's dispatcher and experts (docs/torchtitan.md)
"""
