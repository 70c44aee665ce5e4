"""Running architectures or paths that have no JAX implementation, through torch.

torch is optional (`jaxengine.extras`): importing this package without it raises
one ``ImportError`` naming the ``torch`` extra, before any module here imports torch.
"""

from jaxengine.extras import require_torch

require_torch("the torch fallback (--model-impl transformers)")
