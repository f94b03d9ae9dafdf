"""Experiments: one-off studies of the online loop (domain shift, swap under load, loss replay), apart
from the product pipelines. Run with `adaflash experiment ...`; results in docs/."""
