"""v4pool: the KV-memory runtime for DeepSeek-V4 serving (Python bindings).

The compiled module (`v4pool.v4pool`, the crate's `python` feature) holds every class and
function; `v4pool.hf` attaches a pool to a transformers `DeepseekV4ForCausalLM`;
`v4pool.mooncake` adapts Mooncake Store as the fleet's shared tier.
"""

from .v4pool import *  # noqa: F401,F403
from .v4pool import V4PoolError, __version__  # noqa: F401
