"""plait: composable parallelism for PyTorch.

The public vocabulary follows torch's composable APIs, so code moves over by changing
imports. See README.md for the tour and DESIGN.md (in the shared folder) for the layout.
"""

from plait.contract import contract
from plait.replicate import ReplicateModule, replicate

__all__ = ["ReplicateModule", "contract", "replicate"]
__version__ = "0.1.0"
