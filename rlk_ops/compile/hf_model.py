"""A whole Hugging Face ``Qwen3ForCausalLM`` on rlk ops, and the rollout engine's view of it.

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    patch_qwen3_model(model)       # every stage of the model on rlk ops
    logits = model(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu).logits   # the trainer
    lm = rollout_model(model)      # the same modules behind the demo model's entry points
    results = RolloutEngine(lm, cache_for(lm, requests, page_size, ...)).run(requests) # the rollout

``patch_qwen3`` (``compile/hf.py``) puts the attention on rlk ops and leaves HF's RMSNorms, SwiGLU MLPs and
lm_head alone, so a token's logits there still depend on what else is in the batch.
``patch_qwen3_model`` replaces those too, each sharing HF's own ``Parameter`` or ``nn.Linear`` modules
(the parameter set, the state-dict keys, tied embeddings and an optimizer built before are unchanged):

* every ``Qwen3RMSNorm`` (each layer's two and the final one) by ``rlk::qk_rmsnorm`` over the hidden dim;
* every ``Qwen3MLP`` by the demo model's (``rollout/model.py``): one ``rlk::linear`` over gate and up,
  the ``rlk_model::swiglu`` op, ``rlk::linear``;
* ``lm_head`` by ``RlkLinear`` (an ``nn.Linear`` whose forward is ``rlk::linear``).

* ``embed_tokens`` by ``RlkEmbedding`` (``rlk_model::embedding``: the gather, and a backward whose sums over
  repeated ids are fixed, so eager and torch.compile agree).

What HF's forward still computes itself is the residual adds (one rounding each; IEEE addition commutes,
so HF's ``residual + x`` is the demo model's ``x + residual``) and the RoPE cos/sin table, which no patched
module reads. Under Inductor the logits are eager's; with ``torch.compile(..., options=EAGER_BITS)`` the
gradients are too.

``rollout_model(model)`` is an ``HFQwen3LM``: a ``TinyQwen3`` whose modules are the patched model's
(nothing copied), so the rollout engine, ``compiled_rollout``, the binding check and the demo run it
(``python -m rlk_ops demo --hf-model DIR``). Its ``forward_train`` gives the logits of HF's own
forward bitwise (``hf_logits``; tests/test_hf_model.py), and its rollout the same bits again.

Dense Qwen3 only: a Qwen3-MoE model's experts (top-k routing, per-expert matmuls) are no rlk ops;
``patch_qwen3`` puts its attention on rlk. transformers is imported only when a function here runs.
"""
from __future__ import annotations

import torch
from torch import nn

import rlk_ops
from rlk_ops.compile.hf import HFQwen3Attention, _refuse, attention_config, patch_qwen3
from rlk_ops.compile.module_checks import check_autocast, check_weight_modules
from rlk_ops.rollout.model import RlkEmbedding, TinyQwen3, TinyQwen3Config, _MLP, _RMSNorm


# torch.compile(model, options=EAGER_BITS): Inductor rounds every intermediate to its dtype where eager does,
# so a model patched whole trains with eager's gradients bitwise (without it Inductor keeps the residual
# stream's gradient sums in fp32; the logits are eager's either way). tests/test_hf_model.py.
EAGER_BITS = {"emulate_precision_casts": True}


class RlkLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is ``rlk::linear`` (batch-invariant), over another ``nn.Linear``'s
    weight and bias ``Parameter`` objects (shared, not copied)."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rlk_ops.linear(x, self.weight, self.bias)


def _hf_modules():
    from transformers.models.qwen3 import modeling_qwen3
    return modeling_qwen3


def _type_name(m) -> str:
    return f"{type(m).__module__}.{type(m).__qualname__}"


def _replaced(model: nn.Module, hf) -> list[tuple[str, nn.Module, type]]:
    """(path, module, the class it must be) of every module ``patch_qwen3_model`` replaces besides the
    attention, in the model's order."""
    out = []
    for i, layer in enumerate(model.model.layers):
        out += [(f"model.layers.{i}.input_layernorm", layer.input_layernorm, hf.Qwen3RMSNorm),
                (f"model.layers.{i}.post_attention_layernorm", layer.post_attention_layernorm, hf.Qwen3RMSNorm),
                (f"model.layers.{i}.mlp", layer.mlp, hf.Qwen3MLP)]
    return out + [("model.norm", model.model.norm, hf.Qwen3RMSNorm), ("lm_head", model.lm_head, nn.Linear),
                  ("model.embed_tokens", model.model.embed_tokens, nn.Embedding)]


def patch_qwen3_model(model: nn.Module, *, split_kv: str = "disabled") -> nn.Module:
    """Puts every stage of a transformers ``Qwen3ForCausalLM`` on rlk ops (the module doc): the
    attention through ``patch_qwen3`` (or as ``patch_qwen3`` left it, with the same ``split_kv``), the
    RMSNorms, MLPs and lm_head here. Returns ``model``. Everything is checked before anything is replaced:
    a model this cannot patch whole is left as it was."""
    where = "patch_qwen3_model"
    hf = _hf_modules()
    if not isinstance(model, hf.Qwen3ForCausalLM):
        moe = getattr(getattr(model, "config", None), "model_type", None) == "qwen3_moe"
        _refuse(where, f"model must be a transformers Qwen3ForCausalLM (a dense Qwen3 with its lm_head), got "
                       f"{_type_name(model)}" + ("; a Qwen3-MoE model's experts are no rlk ops: patch_qwen3 puts "
                                                 "its attention on rlk" if moe else ""))
    act = getattr(model.config, "hidden_act", None)
    if act != "silu":
        _refuse(where, f"config.hidden_act must be 'silu' (the rlk MLP computes SwiGLU), got {act!r}")
    for path, m, kind in _replaced(model, hf):
        if type(m) is not kind:
            _refuse(where, f"{path} must be transformers' {kind.__module__}.{kind.__qualname__}, got "
                           f"{_type_name(m)} (already patched, or replaced by another library: an adapter's "
                           f"forward would be bypassed, since the rlk modules read the weights)")
    if model.lm_head.bias is not None:   # (HF's Qwen3 head has none; a model edited to have one is refused)
        _refuse(where, "lm_head must have no bias (Qwen3's has none)")
    RlkEmbedding.check_settings(f"rlk_ops.compile.hf.{where}", model.model.embed_tokens, "model.embed_tokens.")
    for i, layer in enumerate(model.model.layers):
        for name in ("gate_proj", "up_proj", "down_proj"):
            proj = getattr(layer.mlp, name)
            if type(proj) is not nn.Linear or proj.bias is not None:
                _refuse(where, f"model.layers.{i}.mlp.{name} must be a torch.nn.Linear without bias (Qwen3's), "
                               f"got {_type_name(proj)}" + (" with a bias" if type(proj) is nn.Linear else ""))
    patched = [layer.self_attn for layer in model.model.layers if type(layer.self_attn) is HFQwen3Attention]
    if patched:   # patch_qwen3 ran before: its policy must be this one
        have = sorted({a.config.split_kv for a in patched})
        want = attention_config(model.config, split_kv).split_kv
        if len(patched) != len(model.model.layers) or have != [want]:
            _refuse(where, f"the attention is already patched ({len(patched)} of {len(model.model.layers)} layers, "
                           f"split_kv {have}); patch_qwen3_model needs every layer's, with split_kv {want!r}: "
                           f"patch the unpatched model once")
    else:
        patch_qwen3(model, split_kv=split_kv)   # (checks the config before it changes anything)
    for layer in model.model.layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = getattr(layer, name)
            setattr(layer, name, _RMSNorm.sharing(norm.weight, norm.variance_epsilon).train(norm.training))
        mlp = layer.mlp
        layer.mlp = _MLP.sharing(mlp.gate_proj, mlp.up_proj, mlp.down_proj).train(mlp.training)
    norm = model.model.norm
    model.model.norm = _RMSNorm.sharing(norm.weight, norm.variance_epsilon).train(norm.training)
    model.lm_head = RlkLinear(model.lm_head).train(model.lm_head.training)
    model.model.embed_tokens = RlkEmbedding.sharing(model.model.embed_tokens)
    return model


class HFQwen3LM(TinyQwen3):
    """The demo model's entry points (``forward_train``, ``forward_rollout``, ``forward_paged``) over a
    model patched by ``patch_qwen3_model``: its embedding, layers, final norm and lm_head are this module's
    (shared, not copied; ``hf_model`` is the patched model itself, not a submodule). The config is a
    ``TinyQwen3Config`` of the model's sizes."""

    def __init__(self, model: nn.Module):
        nn.Module.__init__(self)
        where = "rollout_model"
        hf = _hf_modules()
        if not isinstance(model, hf.Qwen3ForCausalLM):
            _refuse(where, f"model must be a transformers Qwen3ForCausalLM patched by patch_qwen3_model, got "
                           f"{_type_name(model)}")
        want = {hf.Qwen3RMSNorm: _RMSNorm, hf.Qwen3MLP: _MLP, nn.Linear: RlkLinear, nn.Embedding: RlkEmbedding}
        attn = [(f"model.layers.{i}.self_attn", layer.self_attn, HFQwen3Attention)
                for i, layer in enumerate(model.model.layers)]
        for path, m, kind in attn + [(p, m, want[k]) for p, m, k in _replaced(model, hf)]:
            if type(m) is not kind:
                _refuse(where, f"{path} is {_type_name(m)}, not rlk's {kind.__qualname__}: call "
                               f"rlk_ops.compile.hf_model.patch_qwen3_model(model) first (the rollout runs every "
                               f"stage on rlk ops, as the patched training forward does)")
        cfg, split = model.config, {layer.self_attn.config.split_kv for layer in model.model.layers}
        if len(split) != 1:
            _refuse(where, f"every layer's attention must have one split_kv policy, got {sorted(split)}")
        att = attention_config(cfg, split.pop())
        if att.attention_bias:
            # (TinyQwen3Config has no bias field; the layers compute theirs, the plain negative control does not)
            _refuse(where, "config.attention_bias must be False for the rollout view (Qwen3 checkpoints have none)")
        self.config = TinyQwen3Config(
            vocab_size=cfg.vocab_size, hidden_size=att.hidden_size, intermediate_size=cfg.intermediate_size,
            num_layers=len(model.model.layers), num_heads=att.num_heads, num_kv_heads=att.num_kv_heads,
            head_dim=att.head_dim, rope_theta=att.rope_theta, rms_norm_eps=att.rms_norm_eps, split_kv=att.split_kv)
        self.embed_tokens = model.model.embed_tokens
        self.layers = model.model.layers
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.__dict__["hf_model"] = model   # (not a submodule: its parameters are listed once, above)

    @staticmethod
    def _train_attention(layer: nn.Module):
        return layer.self_attn.forward_train   # (its module call is HF's signature)

    def _check_setup(self, where: str, tokens: torch.Tensor) -> None:
        check_weight_modules(where, self, ("lm_head",), RlkLinear)
        check_autocast(where, tokens.device.type, self.lm_head.weight.dtype)


def rollout_model(model: nn.Module) -> HFQwen3LM:
    """The rollout engine's view of a model patched by ``patch_qwen3_model`` (see ``HFQwen3LM``)."""
    return HFQwen3LM(model)


def hf_logits(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """HF's own forward of a patched model over packed sequences (padding-free: one row and
    ``cu_seq_lens_q`` / ``_k``, as ``DataCollatorWithFlattening`` builds them): tokens and positions [T],
    cu_seqlens [B+1] -> logits [T, vocab]. The call a trainer makes (without ``max_length_q`` / ``_k``: the
    patched layers do not read them, and computing them here was a host sync on CUDA)."""
    out = model(input_ids=tokens[None], position_ids=positions[None], cu_seq_lens_q=cu_seqlens,
                cu_seq_lens_k=cu_seqlens, use_cache=False)
    return out.logits[0]


def generate(model: nn.Module, prompts, max_new_tokens: int, *, stop_tokens=None, seed: int | None = 0,
             temperature: float = 1.0, page_size: int = 16, max_running: int = 8, chunk: int = 512) -> list:
    """Generates with a model patched by ``patch_qwen3_model`` on the rlk rollout engine (transformers'
    ``generate`` is refused: HF's KV cache): ``prompts`` (lists of token ids) -> one ``SeqResult`` per prompt,
    in order, with the generated tokens, their log-probs (the trainer's ``completion_logprobs`` of the same
    tokens, bitwise) and ``finish_reason``. ``stop_tokens``: the ids that end a sequence; None takes the
    model's ``generation_config.eos_token_id`` (or its config's), [] none. ``seed``: the Gumbel-max sampler's
    (None: greedy); ``temperature``: it samples from softmax(logits / T) and records that distribution's
    log-probs (``completion_logprobs(..., temperature=T)``'s bits). A paged cache for ``max_running``
    sequences at a time is made for the call."""
    from rlk_ops.rollout.engine import Request, RolloutEngine, Sampler, cache_for

    lm = model if isinstance(model, HFQwen3LM) else rollout_model(model)
    if stop_tokens is None:
        eos = getattr(getattr(lm.hf_model, "generation_config", None), "eos_token_id", None)
        eos = getattr(lm.hf_model.config, "eos_token_id", None) if eos is None else eos
        stop_tokens = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        _refuse("generate", f"prompts must be a non-empty list of token-id lists, got {type(prompts).__name__}")
    requests = [Request(i, list(p) if isinstance(p, (list, tuple)) else p, max_new_tokens, stop_tokens=stop_tokens)
                for i, p in enumerate(prompts)]
    device = lm.embed_tokens.weight.device
    engine = RolloutEngine(lm, cache_for(lm, requests, page_size, max_running, device), max_running=max_running,
                           chunk=chunk, sampler=Sampler(seed, temperature))
    with torch.inference_mode():
        return engine.run(requests)


def load(path: str, *, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
         split_kv: str = "disabled") -> HFQwen3LM:
    """A Qwen3 checkpoint from a local folder (``save_pretrained``'s layout), patched whole, as the
    rollout engine's view: what ``python -m rlk_ops demo --hf-model DIR`` runs. Reads no network."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("rlk_ops.compile.hf_model.load needs transformers (pip install 'rlk-ops[test]' or "
                          "pip install transformers)") from e
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(config, "model_type", None) != "qwen3":
        _refuse("load", f"{path} must hold a dense Qwen3 checkpoint (config model_type 'qwen3'), got model_type "
                        f"{getattr(config, 'model_type', None)!r}")
    model = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device)
    return rollout_model(patch_qwen3_model(model, split_kv=split_kv))
