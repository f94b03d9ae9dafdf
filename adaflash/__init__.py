"""AdaFlash: online-learning speculative decoding with a block-diffusion drafter."""

__version__ = "0.1.0"
