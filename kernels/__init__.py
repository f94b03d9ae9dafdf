"""Fused kernels (Triton on GPU, PyTorch fallback elsewhere), installed as `adaflash.kernels`.

This directory sits at the checkout's root, so wherever the root is on sys.path (`python -m pytest`,
`python -m adaflash...` run from it) a plain `import kernels` finds it first, ahead of Hugging Face's
`kernels` distribution that transformers imports (transformers 5.25 requires it). Imported under that
top-level name, this module steps aside: it loads the installed distribution from the rest of sys.path in its
place. Where none is installed it stays what it was, an empty package without a version, which transformers
(up to 5.24: it imports a package it finds no metadata for) takes for one it cannot use.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _rest)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # the import statement hands back whatever sys.modules holds now
        _spec.loader.exec_module(_module)
