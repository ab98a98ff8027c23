"""ditron-inductor: a torch.compile backend that fuses tensor-parallel communication into matmuls.

Use it as `torch.compile(model, backend="ditron")`; no import of this package is needed.
The package itself stays light on import: torch loads `log_names` while torch is being imported.
"""

__version__ = "0.1.0"
