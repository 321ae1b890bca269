"""One module per stage: public function, op definition, fake, autograd, validation.
Importing this package registers every ``torch.ops.rlk`` op."""
from rlk_ops.ops import (  # noqa: F401 - imported for registration
    attention,
    collectives,
    linear,
    merge,
    paged_attention,
    paged_attention_auto,
    paged_kv,
    qk_norm_rope,
    qk_rmsnorm,
    rope,
)
