"""ditron-inductor: a torch.compile backend that fuses tensor-parallel communication into matmuls.

Use it as `torch.compile(model, backend="ditron")`; no import of this package is needed.
"""

__version__ = "0.1.0"
