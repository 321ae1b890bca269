"""Hugging Face transformers Qwen3 models on the rlk attention block (the training side).

    model = transformers.AutoModelForCausalLM.from_pretrained(...)     # a Qwen3 checkpoint
    rlk_ops.compile.hf.patch_qwen3(model)                             # every self_attn -> rlk ops
    loss = model(input_ids, labels=labels, use_cache=False).loss      # trains through rlk::attention_fwd/_bwd

``patch_qwen3`` replaces each decoder layer's ``self_attn`` with an ``HFQwen3Attention``: the rlk
``Qwen3Attention`` block (fused QKV ``rlk::linear``, ``rlk::qk_rmsnorm``, ``rlk::rope``,
``rlk::attention_fwd``, ``rlk::linear``) behind Hugging Face's call signature. It keeps the layer's own
``nn.Linear`` modules and norm weight ``Parameter`` objects, so the parameter set, the state-dict keys
and an optimizer built before the patch are unchanged. The rollout side runs the same block
(``forward_rollout`` over a paged cache), which is what makes the training forward's rows bitwise
equal to the rollout's; the rest of an HF model (MLP, layer norms, lm_head) stays HF's and is not
covered by any rlk claim here (``compile/hf_model.py``'s ``patch_qwen3_model`` puts it on rlk ops too).

What the block computes is the HF attention of the model's config (checked at the patch): full causal
attention, default RoPE (no scaling) over the whole head, no dropout. Qwen3 and Qwen3-MoE models (whose
attention is Qwen3's; the experts stay HF's). Sequences come in one of three
ways, nothing else:

* padding-free packing, as ``transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
  builds it: one row (batch size 1) and ``cu_seq_lens_q`` (with ``cu_seq_lens_k`` equal to it) in the
  model call's keyword arguments, which HF hands to every attention layer;
* one sequence per row, every token real: ``position_ids`` must step by 1 along each row (a reset
  would be a packed row, which HF's own attention masks per sequence);
* a padded batch (``attention_mask``): each row's unmasked tokens are one sequence, packed varlen and
  put back; padding positions get zeros. Static shapes: eager and under torch.compile alike.

HF's KV cache (generation: use the rlk rollout engine), attention weights and prepared 4-D masks are
refused with the reason. transformers is imported only by ``patch_qwen3``.
"""
from __future__ import annotations

import torch
from torch import nn

from rlk_ops.compile.block import Qwen3Attention, Qwen3AttentionConfig, _Norm
from rlk_ops.ops._validate import RlkInputError, short_repr, value_checks_enabled

ATTN_IMPLEMENTATION = "rlk"   # the name registered with transformers' attention and mask interfaces
# model_type -> transformers' attention class the patch replaces (Qwen3-MoE's attention is Qwen3's)
_ATTENTION_CLASSES = {
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3Attention"),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeAttention"),
}


def _refuse(where: str, msg: str):
    raise RlkInputError(f"rlk_ops.compile.hf.{where}: {msg}")


def attention_config(hf_config, split_kv: str = "disabled") -> Qwen3AttentionConfig:
    """The ``Qwen3AttentionConfig`` of an HF ``Qwen3Config`` (transformers 4.x ``rope_theta`` or 5.x
    ``rope_parameters``). Refuses what the block does not compute: another model type, RoPE scaling or
    partial rotary, sliding-window layers, attention dropout."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _ATTENTION_CLASSES:
        _refuse("attention_config", f"config.model_type must be one of {list(_ATTENTION_CLASSES)}, got "
                                    f"{model_type!r}")
    rope = getattr(hf_config, "rope_parameters", None)
    if rope is None:   # transformers 4.x
        rope = dict(getattr(hf_config, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(hf_config, "rope_theta", None))
    if not isinstance(rope.get("rope_theta"), (int, float)) or isinstance(rope.get("rope_theta"), bool):
        _refuse("attention_config", f"config must give the RoPE base (rope_parameters['rope_theta'] or rope_theta) "
                                    f"as a number, got {short_repr(rope.get('rope_theta'))}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        _refuse("attention_config", f"config RoPE type must be 'default' (rlk::rope has no scaling), got "
                                    f"{rope_type!r}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse("attention_config", f"config partial_rotary_factor must be 1.0 (Qwen3 rotates the whole head), "
                                    f"got {rope['partial_rotary_factor']!r}")
    layer_types = getattr(hf_config, "layer_types", None) or ()
    if getattr(hf_config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        _refuse("attention_config", f"every layer must be full attention (the rlk block has no sliding window), "
                                    f"got use_sliding_window={getattr(hf_config, 'use_sliding_window', None)!r}, "
                                    f"layer_types={short_repr(list(layer_types))}")
    dropout = getattr(hf_config, "attention_dropout", 0.0)
    if dropout:
        _refuse("attention_config", f"config.attention_dropout must be 0 (the rlk block has no dropout), got "
                                    f"{dropout!r}")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return Qwen3AttentionConfig(
        hidden_size=hf_config.hidden_size, num_heads=heads, num_kv_heads=hf_config.num_key_value_heads,
        head_dim=head_dim, rope_theta=float(rope["rope_theta"]), rms_norm_eps=float(hf_config.rms_norm_eps),
        attention_bias=bool(hf_config.attention_bias), split_kv=split_kv)


class HFQwen3Attention(Qwen3Attention):
    """The rlk block behind HF's ``Qwen3Attention.forward`` signature (see the module doc).
    ``forward_train`` and ``forward_rollout`` are the block's own entry points."""

    def __init__(self, config: Qwen3AttentionConfig, layer_idx: int | None = None, **factory):
        super().__init__(config, **factory)
        self.layer_idx = layer_idx

    @classmethod
    def from_hf(cls, hf_attn: nn.Module, config: Qwen3AttentionConfig) -> "HFQwen3Attention":
        """Wraps ``hf_attn``'s own projection modules and norm weights (shared, not copied)."""
        dtype = hf_attn.q_proj.weight.dtype
        with torch.device("meta"):   # the block's own parameters are replaced below: allocate nothing
            new = cls(config, getattr(hf_attn, "layer_idx", None), dtype=dtype)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(new, name, getattr(hf_attn, name))
        for name in ("q_norm", "k_norm"):
            norm = _Norm(config.head_dim, device="meta")
            norm.weight = getattr(hf_attn, name).weight
            setattr(new, name, norm)
        new.train(hf_attn.training)
        return new

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, cache=None, position_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                max_length_q=None, max_length_k=None, **kwargs):
        """hidden_states [B, S, hidden] -> (output [B, S, hidden], None). ``position_embeddings`` (HF's
        cos/sin) are not read: the block rotates by ``position_ids`` with the config's theta. HF's
        ``max_length_q``/``_k`` are not read either: the attention op derives the longest sequence from the
        lengths themselves."""
        where = "HFQwen3Attention.forward"
        if past_key_values is not None or cache is not None:
            _refuse(where, "HF's KV cache is not supported: the rlk block is the training forward here (call the "
                           "model with use_cache=False; generation runs on the rlk rollout engine: "
                           "rlk_ops.compile.hf_model.generate(model, prompts, max_new_tokens) for a model patched "
                           "by patch_qwen3_model)")
        if kwargs.get("output_attentions"):
            _refuse(where, "output_attentions=True: the rlk attention does not form attention weights")
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            _refuse(where, f"hidden_states must be [B, S, hidden_size], got "
                           f"{list(getattr(hidden_states, 'shape', [])) or short_repr(hidden_states)}")
        b, s, hidden = hidden_states.shape
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[1] != s \
                or position_ids.shape[0] not in (1, b):
            got = list(position_ids.shape) if isinstance(position_ids, torch.Tensor) else short_repr(position_ids)
            _refuse(where, f"position_ids must be a tensor [B, S] or [1, S] with S = {s} (transformers passes "
                           f"the model's), got {got}")
        positions = position_ids.expand(b, s).reshape(b * s)
        if attention_mask is not None:   # (under the rlk mask implementation: the 2-D mask, see _padding_mask)
            return self._padded(where, hidden_states, positions, attention_mask, cu_seq_lens_q, cu_seq_lens_k), None
        if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
            cu_seqlens = self._packed(where, b, cu_seq_lens_q, cu_seq_lens_k)
        else:
            _rows_are_sequences(where, position_ids)
            cu_seqlens = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=hidden_states.device)
        out = self.forward_train(hidden_states.reshape(b * s, hidden), positions, cu_seqlens)
        return out.reshape(b, s, hidden), None

    def _padded(self, where, hidden_states, positions, attention_mask, cu_q, cu_k):
        """A padded batch: each row's unmasked tokens are one sequence (in row order, gaps closed up, which
        is the set of keys HF's causal padding mask leaves each query); padding positions get zeros. Shapes
        stay static, so this runs under torch.compile too: a stable sort moves each row's tokens in front of
        its padding, the B x S rows are packed as 2B sequences (row 0's tokens, row 0's padding, row 1's
        tokens, ...; a row without padding, or of padding only, gives an empty one), run, masked and moved
        back. Padding attends only to padding, and its rows are discarded (SDPA computes padding too)."""
        b, s, hidden = hidden_states.shape
        if cu_q is not None or cu_k is not None:
            _refuse(where, "attention_mask and cu_seq_lens_q / cu_seq_lens_k together: pass one of them (a padded "
                           "batch, or sequences packed padding-free)")
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (b, s):
            _refuse(where, f"attention_mask must be the 2-D padding mask [B, S] = [{b}, {s}] (1 = token, 0 = "
                           f"padding), got {list(getattr(attention_mask, 'shape', [])) or short_repr(attention_mask)}"
                           f" (a prepared 4-D mask is not read: the block's attention is causal per sequence)")
        keep = attention_mask.to(torch.bool)
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)   # each row: its tokens, then padding
        lengths = keep.sum(1)
        segments = torch.stack([lengths, s - lengths], 1).reshape(2 * b)
        cu_seqlens = torch.nn.functional.pad(segments.cumsum(0), (1, 0)).to(torch.int32)
        index = order[..., None].expand(b, s, hidden)
        rows = self.forward_train(hidden_states.gather(1, index).reshape(b * s, hidden),
                                  positions.reshape(b, s).gather(1, order).reshape(b * s), cu_seqlens)
        real = torch.arange(s, device=keep.device) < lengths[:, None]    # (in the sorted order)
        rows = torch.where(real[..., None], rows.reshape(b, s, hidden), rows.new_zeros(()))
        return torch.empty_like(rows).scatter(1, index, rows)

    @staticmethod
    def _packed(where, b, cu_q, cu_k):
        if b != 1:
            _refuse(where, f"cu_seq_lens_q packs sequences into one row: hidden_states must have batch size 1, "
                           f"got {b}")
        if not isinstance(cu_q, torch.Tensor) or not isinstance(cu_k, torch.Tensor):
            _refuse(where, f"cu_seq_lens_q and cu_seq_lens_k come together, as tensors (self-attention over packed "
                           f"sequences: the same values), got {type(cu_q).__name__} and {type(cu_k).__name__}")
        if cu_k is not cu_q:
            if cu_k.shape != cu_q.shape or cu_k.device != cu_q.device:
                _refuse(where, f"cu_seq_lens_k must equal cu_seq_lens_q (self-attention over the same packed "
                               f"sequences), got shapes {list(cu_k.shape)} and {list(cu_q.shape)} on {cu_k.device} "
                               f"and {cu_q.device}")
            _value_check(where, (cu_q.to(torch.int64) == cu_k.to(torch.int64)).all(),
                         lambda: f"cu_seq_lens_k must equal cu_seq_lens_q (self-attention over the same packed "
                                 f"sequences), got {short_repr(cu_k.tolist())} and {short_repr(cu_q.tolist())}")
        return cu_q.to(torch.int32)   # (rlk::attention_fwd checks it against the token count)


def _value_check(where: str, ok: torch.Tensor, message) -> None:
    """A check of tensor values (``ok`` a bool tensor). Eager: on the host, CPU always, CUDA while value
    checks are on (one sync), raising ``RlkInputError(message())``. Compiled: an in-graph assert (on
    CUDA a device-side assert), since reading the value would break the graph."""
    if torch.compiler.is_compiling():
        torch._assert_async(ok, f"rlk_ops.compile.hf.{where}: a value check failed (run eagerly for the details)")
    elif value_checks_enabled(ok, where) and not bool(ok):
        _refuse(where, message())


def _rows_are_sequences(where: str, position_ids: torch.Tensor) -> None:
    """Each row one sequence: its positions step by 1. A reset inside a row is HF's packed-by-position_ids
    format, which HF's own attention masks per sequence; read as one sequence it would attend across
    sequences."""
    if position_ids.shape[1] < 2:
        return
    bad = position_ids[:, 1:] - position_ids[:, :-1] != 1

    def message():
        row, col = bad.nonzero()[0].tolist()
        return (f"position_ids must step by 1 along each row (one sequence per row), got position_ids[{row}, "
                f"{col}:{col + 2}] = {position_ids[row, col:col + 2].tolist()}: packed sequences need "
                f"cu_seq_lens_q / cu_seq_lens_k")
    _value_check(where, ~bad.any(), message)


def _register() -> None:
    """Registers ``ATTN_IMPLEMENTATION`` with transformers: as a mask implementation, ``_padding_mask``
    (the 2-D padding mask, which the patched layers pack); as an attention function it raises, since only an
    unpatched attention layer would call it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def attention(module, *args, **kwargs):
        raise RuntimeError(f"rlk_ops.compile.hf: {type(module).__name__} was not replaced by patch_qwen3 but "
                           f"runs with attn_implementation={ATTN_IMPLEMENTATION!r}")
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _padding_mask)


def _padding_mask(batch_size=None, q_length=None, kv_length=None, attention_mask=None, **kwargs):
    """transformers' mask hook for the rlk implementation: the 2-D padding mask as given (its last
    ``kv_length`` columns, as HF slices it), None without one; the patched layers pack by it. HF's own
    FlashAttention hook drops a mask of all ones, a branch on the mask's values that
    torch.compile(fullgraph=True) cannot trace; an all-ones mask packs to the rows' own sequences."""
    return None if attention_mask is None else attention_mask[:, -kv_length:]


def patch_qwen3(model: nn.Module, *, split_kv: str = "disabled") -> nn.Module:
    """Replaces every HF ``Qwen3Attention`` in ``model`` (a transformers Qwen3 or Qwen3-MoE model, e.g.
    ``Qwen3ForCausalLM``; ``Qwen3MoeAttention`` there) with an ``HFQwen3Attention`` sharing its weights; sets the model's attention
    implementation to ``"rlk"``, and makes a call that does not pass ``use_cache`` run without HF's KV cache
    (a forward pre-hook; the config's ``use_cache`` is left as it was). Returns ``model``. Patch before
    wrapping the model (FSDP, DDP, torch.compile). An adapter on an attention projection (a peft LoRA
    wrapper, added before or after the patch) is refused at the forward: the block reads the projection's
    weight and never calls it, so the adapter would add nothing."""
    import importlib

    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        _refuse("patch_qwen3", f"model must be a transformers PreTrainedModel (a Qwen3 model), got "
                               f"{type(model).__module__}.{type(model).__qualname__}")
    config = attention_config(model.config, split_kv)
    module, class_name = _ATTENTION_CLASSES[model.config.model_type]
    hf_class = getattr(importlib.import_module(module), class_name)
    targets = [(name, m) for name, m in model.named_modules() if type(m) is hf_class]
    if not targets:
        found = sorted({type(m).__qualname__ for m in model.modules() if "Attention" in type(m).__qualname__})
        _refuse("patch_qwen3", f"model has no transformers {class_name} module to replace (attention modules "
                               f"found: {found or 'none'}; already patched, or wrapped by another library?)")
    _register()
    for name, hf_attn in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, HFQwen3Attention.from_hf(hf_attn, config))
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    # a call that does not say use_cache runs without HF's KV cache (which the block refuses); the config's
    # use_cache is left as it was, so a checkpoint saved after the patch keeps it (before session 46 the
    # patch set it to False, and save_pretrained wrote that)
    for m in [model, *(m for m in model.modules() if isinstance(m, PreTrainedModel) and m is not model)]:
        m.register_forward_pre_hook(_no_cache_unless_asked, with_kwargs=True)
    return model


def _no_cache_unless_asked(module, args, kwargs):
    if kwargs.get("use_cache") is None:
        kwargs["use_cache"] = False
    return args, kwargs
