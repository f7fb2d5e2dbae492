"""Every Hugging Face architecture with a causal-LM, masked-LM or sequence-classification head,
and each one's model built tiny from its own default config (``examples/hf_architectures.py``
runs them through ring_cp).

``architectures()`` lists one ``(model_type, head, class_name)`` per model type of the installed
``transformers`` (causal LM if the type has one, else masked LM, else sequence classification).
``tiny_config(model_type)`` is that type's default config shrunk by general rules read off the
config's field names (hidden 64, 2 layers, 4 heads, vocab 128, no dropout, ...), with per-family
overrides only where a family has a constraint the rules cannot know; ``build_model`` builds the
head model from it and ``make_batch`` the random batch every rank passes whole.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from hf_models import VOCAB

# -- what is swept ---------------------------------------------------------------------------
# Head kinds in order of preference, with the transformers auto-mapping that lists their classes.
HEADS = (("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"), ("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
         ("seq-cls", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"))


def architectures() -> List[Tuple[str, str, str]]:
    """Sorted ``(model_type, head, class_name)``, one per model type of the installed transformers
    that has a causal-LM, masked-LM or sequence-classification class (in that preference)."""
    from transformers.models.auto import modeling_auto

    chosen: Dict[str, Tuple[str, str]] = {}
    for head, mapping in HEADS:
        for model_type, class_name in getattr(modeling_auto, mapping).items():
            chosen.setdefault(model_type, (head, class_name))
    return sorted((t, head, cls) for t, (head, cls) in chosen.items())


def architecture(model_type: str) -> Tuple[str, str, str]:
    """The ``(model_type, head, class_name)`` row of :func:`architectures` for ``model_type``."""
    rows = [row for row in architectures() if row[0] == model_type]
    if not rows:
        raise KeyError(f"{model_type!r} has no causal-LM, masked-LM or sequence-classification class")
    return rows[0]


def code_chunk_size(model_type: str) -> Optional[int]:
    """The chunk size the type's modeling code fixes itself (a module-level function's int default
    ``chunk_size=64``: Kimi Delta Attention's torch path), which no config field shrinks; else None."""
    import importlib
    import inspect

    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        return None
    sizes = {p.default for fn in vars(module).values() if inspect.isfunction(fn) and fn.__module__ == module.__name__
             for p in inspect.signature(fn).parameters.values() if p.name == "chunk_size" and type(p.default) is int}
    return max(sizes) if sizes else None


def sweep_seq_len(model_type: str, seq_len: int, world: int) -> int:
    """The sweep's sequence length for ``model_type``: ``seq_len``, or, where the model code fixes a
    chunk size C and its config has no ``chunk_size`` to shrink, 2·N·C, so that each of the 2N zig-zag
    runs holds a whole chunk (and each rank two), as the configs' shrunk chunks do at ``seq_len``."""
    chunk = code_chunk_size(model_type)
    if not chunk or _get(tiny_config(model_type), "chunk_size") is not None:
        return seq_len
    return max(seq_len, 2 * world * chunk)


# -- tiny configs ----------------------------------------------------------------------------
HIDDEN, LAYERS, HEADS_N, KV_HEADS, HEAD_DIM, FFN, POSITIONS = 64, 2, 4, 2, 16, 128, 256
EXPERTS, TOP_K, EXPERT_FFN, RANK, WINDOW = 4, 2, 32, 32, 16


def _names(value: Any, *names: str) -> Dict[str, Any]:
    """``{name: value}`` for every name."""
    return dict.fromkeys(names, value)


# Config field -> tiny value. Matched against the field's own name and the canonical name its
# class's ``attribute_map`` gives it (GPT-2's ``n_embd`` is ``hidden_size``).
SIZES: Dict[str, Any] = {
    **_names(HIDDEN, "hidden_size", "d_model", "n_embd", "dim", "emb_dim", "word_embed_proj_dim", "embedding_size",
             "embedding_dim", "lru_width", "adapter_in_dim", "adapter_out_dim", "adapter_input_size",
             "backbone_hidden_size", "hidden_size_global", "d_latents"),
    **_names(LAYERS, "num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
             "num_decoder_layers", "num_encoder_layers", "num_self_attends_per_block"),
    **_names(HEADS_N, "num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads",
             "encoder_attention_heads", "decoder_attention_heads", "num_encoder_attention_heads",
             "num_decoder_attention_heads", "num_self_attention_heads", "num_cross_attention_heads",
             "index_n_heads", "linear_num_heads", "linear_num_value_heads"),
    **_names(HEAD_DIM, "head_dim", "d_kv", "d_head", "attention_head_size", "dim_head", "kv_channels",
             "attention_head_dim", "qk_head_dim", "v_head_dim", "index_head_dim", "linear_key_head_dim",
             "linear_value_head_dim", "linear_head_dim", "mamba_d_head", "mamba_head_dim", "mamba_headdim"),
    **_names(FFN, "intermediate_size", "d_ff", "ffn_dim", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim",
             "ffn_hidden_size", "d_inner", "dim_ff", "dff", "mlp_dim", "hidden_dim", "feed_forward_size",
             "dense_intermediate_size", "intermediate_size_mlp"),
    **_names(EXPERT_FFN, "moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
             "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size"),
    **_names(POSITIONS, "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "context_length",
             "max_target_positions", "max_source_positions", "max_sequence_length"),
    **_names(False, "use_cache"),
}
# Set only where the default sets them (None keeps its meaning: no low-rank query, full rotary, ...).
SIZES_IF_SET: Dict[str, int] = {
    **_names(RANK, "kv_lora_rank", "q_lora_rank"),  # MLA's low-rank projections
    **_names(HEAD_DIM // 2, "qk_nope_head_dim", "qk_rope_head_dim", "rotary_dim"),  # halves of a 16-wide head
    **_names(16, "ssm_state_size", "mamba_d_state", "state_size", "time_step_rank", "mamba_dt_rank"),
    # Mamba-2 heads x head dim (16) must be the inner width, expand (2) x hidden (64) = 128.
    **_names(2 * HIDDEN // HEAD_DIM, "mamba_n_heads", "mamba_num_heads"),
    **_names(2 * HIDDEN, "mamba_d_ssm"),
}
# Fields only ever made smaller: a family whose default is already below the tiny value keeps it.
KV_HEADS_FIELDS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_n_heads", "num_query_groups",
                   "multi_query_group_num", "linear_num_key_heads")
AT_MOST: Dict[str, int] = {
    **_names(KV_HEADS, *KV_HEADS_FIELDS),  # a family with GQA gets 2 KV heads of 4; MQA (1) stays MQA
    **_names(EXPERTS, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
             "zero_expert_num"),
    **_names(TOP_K, "num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "moe_top_k"),
    **_names(1, "n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "n_group", "num_expert_group",
             "topk_group", "first_k_dense_replace", "num_dense_layers"),  # 2 layers: one dense, one MoE
    **_names(EXPERT_FFN, "shared_intermediate_size"),  # 0 = no shared expert
    **_names(WINDOW, "sliding_window", "sliding_window_size", "attention_window", "local_attention",
             "attention_window_size", "local_attention_window_len", "attention_chunk_size"),  # < S: it matters
    # a chunked recurrence's chunks (Mamba-2's SSD, lightning attention's blocks, xLSTM): several per
    # sequence, so the tiny model crosses chunk boundaries as a long one does
    **_names(WINDOW, "chunk_size", "mamba_chunk_size", "block_size"),
}
# Hybrid stacks placing a kind of layer every ``period`` layers from ``offset`` (Jamba's attention
# every 8th from the 4th): both kinds within the 2 layers.
_PERIODIC = {"_layer_period": 2, "_layer_offset": 1}
_RANDOM = re.compile(r"dropout|pdrop|drop_rate|drop_prob|layerdrop|drop_path|jitter")  # training-time noise -> 0
_TOKEN = re.compile(r"_token_ids?$|_token_index$|^(pad|bos|eos|unk|sep|cls|mask)_(id|index)$")
_FIRST_TOKENS = {"pad": 0, "bos": 1, "eos": 2, "decoder_start": 2, "sep": 3}  # others: from VOCAB - 1 down
LOW_ID, HIGH_ID = 4, VOCAB - 16  # random tokens are drawn from [LOW_ID, HIGH_ID): never a special token

# Per-family overrides, applied after the general rules, only where a family has a real
# constraint the rules cannot know (the comment says which). A dict value for a sub-config
# field (``text_config``) is applied inside that sub-config.
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# Dots 3: KV heads = heads (its validator); its sliding layers' shapes are swa_* keyword arguments.
_DOTS3 = dict(num_key_value_heads=HEADS_N, swa_num_attention_heads=HEADS_N, swa_num_key_value_heads=HEADS_N,
              swa_q_lora_rank=RANK, swa_kv_lora_rank=RANK, swa_head_dim=HEAD_DIM,
              swa_qk_nope_head_dim=HEAD_DIM // 2, swa_v_head_dim=HEAD_DIM)
# Qwen4-Exp's default layers are QSA-indexed attention, whose indexer fields default to None:
# one key head, the budget a multiple of the compression ratio.
_QSA = dict(indexer_n_heads=HEADS_N, indexer_kv_heads=1, indexer_head_dim=HEAD_DIM, indexer_budget=32,
            indexer_compress_ratio=4)
# KV sharing: the last layers reuse the K/V of the last earlier layer of their type, so both
# types need a producer: 4 layers, 2 shared (and per-layer lists of 4).
_SHARED_KV = dict(num_hidden_layers=4, num_kv_shared_layers=2,
                  layer_types=["sliding_attention", "full_attention"] * 2)
_GEMMA3N = dict(_SHARED_KV, intermediate_size=FFN, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0])
OVERRIDES: Dict[str, Dict[str, Any]] = {
    # Defaults that do not build or run a model in this transformers (checkpoints set these):
    "cohere_compass_text": {"rope_parameters": {"full_attention": dict(_ROPE)}},  # read per layer type; default {}
    # DBRX's attention reads attn_config.rope_theta (not a field) and clamps Q/K/V to +-clip_qkv (None fails).
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    "deepseek_v2": {"num_experts_per_tok": TOP_K},  # None: the router's top-k fails
    "dots1": {"n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K, "n_shared_experts": 1},  # None
    "esm": {"pad_token_id": 0, "mask_token_id": VOCAB - 1},  # None: read in the forward
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # None: read per layer
    "qwen4_exp": {"text_config": _QSA},
    "qwen4_exp_text": _QSA,
    **{t: {"decoder_start_token_id": 0} for t in ("t5", "mt5", "umt5")},  # missing: the decoder input shift
    "xmod": {"default_language": "en_XX"},  # None: it routes through a per-language adapter
    # Hybrid families whose default stack has no softmax attention layer (all Mamba, all
    # convolution) while their checkpoints interleave some: layer 1 is attention.
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # Constraints between fields:
    "dots3_note": {"text_config": _DOTS3},
    "dots3_note_text": _DOTS3,
    "esmc": {"num_key_value_heads": HEADS_N},  # no GQA: KV heads = heads
    "gemma3n": {"text_config": _GEMMA3N},
    "gemma3n_text": _GEMMA3N,
    "gemma4_unified_assistant": {"text_config": _SHARED_KV},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # (kinds, repeats) must expand to one per layer
    "layoutlmv3": {"coordinate_size": 12, "shape_size": 8},  # 4 coordinate + 2 shape embeddings = hidden (64)
    "lilt": {"hidden_size": 96},  # six box embeddings of hidden // 6 concatenated: hidden divisible by 6 and 4
    "longcat_flash": {"head_dim": HEAD_DIM // 2},  # its rotary embedding is head_dim wide: the qk_rope part
    "mamba2": {"num_heads": 2 * HIDDEN // HEAD_DIM},  # heads x head dim = expand x hidden
    "perceiver": {"max_position_embeddings": 64},  # the masked-LM decoder queries every position: = S (64)
    # ReformerModelWithLMHead requires is_decoder; the axial position factors sum to the hidden size
    # and, in training, multiply to the sequence length (64).
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [HIDDEN // 2, HIDDEN // 2], "axial_pos_shape": [8, 8]},
    "zamba": {"layers_block_type": ["hybrid", "hybrid"]},  # its hybrid layers share one block: two of them
}

_KEEP = object()  # "leave the default"


def tiny_config(model_type: str) -> Any:
    """The default config of ``model_type`` shrunk (hidden 64, 2 layers, 4 heads, KV heads 2 where
    the family has them, intermediate 128, vocab 128, max positions 256, head dim 16, no dropout,
    ``use_cache=False``, 4 experts top-2, windows 16, special tokens inside the vocabulary), nested
    configs (``text_config``, ``decoder``, ...) shrunk alike."""
    from transformers import CONFIG_MAPPING

    _, head, _ = architecture(model_type)
    cls = CONFIG_MAPPING[model_type]
    cfg = _tiny(cls, OVERRIDES.get(model_type, {}))
    if head == "seq-cls" and getattr(cfg, "pad_token_id", 0) is None:
        cfg.pad_token_id = 0  # the classification head finds each row's last token by it
    return cfg


def _tiny(cls: type, overrides: Dict[str, Any], default: Any = None) -> Any:
    """``cls`` built from its shrunk fields, its sub-configs shrunk the same way (recursively)."""
    from transformers import PreTrainedConfig

    if default is None:
        default = _default(cls)
    fields = _shrunk_fields(cls, default)
    fields.update(_token_ids(default, fields))
    for key in getattr(cls, "sub_configs", None) or {}:
        sub = _get(default, key)
        if isinstance(sub, PreTrainedConfig):
            fields[key] = _tiny(type(sub), overrides.get(key, {}), sub)
    fields.update({k: v for k, v in overrides.items() if not isinstance(v, dict) or k not in fields})
    return cls(**fields)


def _default(cls: type) -> Any:
    """``cls()``; for a class whose defaults do not validate, an instance without validation."""
    try:
        return cls()
    except Exception:  # noqa: BLE001 - e.g. a default that its own validator rejects
        obj = object.__new__(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(obj, f.name, None if default is dataclasses.MISSING else default)
        return obj


def _declared(cls: type) -> Dict[str, Any]:
    """Field name -> declared default (None for computed fields) of a config class."""
    if dataclasses.is_dataclass(cls):
        return {f.name: None if f.default is dataclasses.MISSING else f.default for f in dataclasses.fields(cls)}
    import inspect

    params = inspect.signature(cls.__init__).parameters
    return {n: None if p.default is inspect.Parameter.empty else p.default for n, p in params.items()
            if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _shrunk_fields(cls: type, default: Any) -> Dict[str, Any]:
    """The fields of ``cls`` the general rules change, with their tiny values."""
    canonical = {actual: name for name, actual in (getattr(cls, "attribute_map", None) or {}).items()}
    n_layers = _int(_get(default, "num_hidden_layers"))
    out: Dict[str, Any] = {}
    for name, declared in _declared(cls).items():
        if _TOKEN.search(name) or name in getattr(cls, "sub_configs", {}):
            continue
        value = _get(default, name)
        new = _tiny_value((name, canonical.get(name, name)), value, n_layers, computed=declared is None)
        if new is not _KEEP:
            out[name] = new
    if out.get("kv_lora_rank") is not None:  # MLA: every head's K/V comes up from one latent, no GQA
        out.update({k: HEADS_N for k in KV_HEADS_FIELDS if k in out})
    return out


def _get(config: Any, name: str) -> Any:
    """``config.name``; a per-layer field (read globally, transformers raises) its global value."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError: the global value
        return vars(config).get(name)


def _int(x: Any) -> Optional[int]:
    """``x`` if it is an int (not a bool), else None."""
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _number(x: Any) -> bool:
    """Whether ``x`` is an int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _tiny_value(names: Tuple[str, str], value: Any, n_layers: Optional[int], computed: bool) -> Any:
    """One field's tiny value by the rules above (``_KEEP``: leave the default)."""
    if any(_RANDOM.search(n) for n in names) and _number(value):
        return type(value)(0)  # 0 or 0.0: a strict config checks the type
    for name in names:
        new = _sized_by_name(name, value)
        if new is not _KEEP:
            return new
    return _layered_value(names[0], value, n_layers, computed)


def _sized_by_name(name: str, value: Any) -> Any:
    """The tiny size a field's name sets (model sizes, caps, periods, GQA heads, the vocabulary), or ``_KEEP``."""
    if name in SIZES and (value is None or _number(value) or isinstance(SIZES[name], bool)):
        return SIZES[name]  # a None head_dim or n_inner means "from the hidden size": the same 16, 128
    if name in SIZES_IF_SET and _number(value):
        return SIZES_IF_SET[name]
    if name in AT_MOST and _number(value):
        return min(int(value), AT_MOST[name])
    periodic = next((v for end, v in _PERIODIC.items() if name.endswith(end)), None)
    if periodic is not None and _int(value) is not None:
        return min(value, periodic)
    if name in KV_HEADS_FIELDS and value is None:  # None: "as many as the heads"; the field says GQA
        return KV_HEADS
    if name == "vocab_size" or "vocab" in name and _int(value) and value > VOCAB:
        return VOCAB  # the vocabulary itself always (a smaller one would not hold the batch's ids)
    return _KEEP


def _layered_value(name: str, value: Any, n_layers: Optional[int], computed: bool) -> Any:
    """A list over the layers, or a dict of per-layer settings by layer index, cut to the tiny
    layer count (see :func:`_per_layer`); ``_KEEP`` for any other value."""
    if isinstance(value, list) and n_layers and n_layers > LAYERS:
        return _per_layer(name, value, n_layers, computed)
    if isinstance(value, dict) and value and all(re.fullmatch(r"\d+", str(k)) and isinstance(v, dict)
                                                 for k, v in value.items()):
        return {k: {n: _pick(v, _tiny_value((n, n), v, None, False)) for n, v in sub.items()}
                for k, sub in value.items() if int(k) < LAYERS}  # per-layer settings, by layer index
    return _KEEP


def _pick(old: Any, new: Any) -> Any:
    """``new`` unless it is ``_KEEP``."""
    return old if new is _KEEP else new


def _per_layer(name: str, value: list, n_layers: int, computed: bool) -> Any:
    """A list over the layers shrunk to 2 layers, keeping a second kind of layer if the default has
    one, softmax attention first (sliding + full, Mamba + attention, dense + MoE); a list of layer
    indices keeps those below 2 (or the last layer, so that a kind the default has stays). A list
    the config computes from the layer count is left to be recomputed unless it mixes kinds."""
    if len(value) == n_layers:
        others = [v for v in value if v != value[0]]
        attention = [v for v in others if re.fullmatch(r"(?!linear).*attention", str(v))]
        other = (attention or others or [None])[0]
        if other is None:
            return _KEEP if computed else value[:LAYERS]
        return [value[0], other]
    if value and all(_int(v) is not None for v in value) and re.search(r"layer|idx|index", name):
        return [i for i in value if 0 <= i < LAYERS] or [LAYERS - 1]
    return _KEEP


def _token_ids(default: Any, fields: Dict[str, Any]) -> Dict[str, Any]:
    """Special-token ids inside the tiny vocabulary: pad 0, bos 1, eos 2, sep 3, the others from
    VOCAB - 1 down (image, audio, mask, ... placeholders), so that none is in [LOW_ID, HIGH_ID)
    where the random batch's tokens are. Equal default ids stay equal (GPT-2's bos = eos)."""
    names = [n for n in _declared(type(default)) if _TOKEN.search(n) and n not in fields]
    roles = {n: re.sub(r"_(token_)?(ids?|index)$", "", n) for n in names}
    new_of: Dict[int, int] = {}  # default id -> tiny id
    free = [i for i in range(VOCAB - 1, HIGH_ID - 1, -1)]

    def tiny(old: int, role: str) -> int:
        if old not in new_of:
            want = _FIRST_TOKENS.get(role)
            new_of[old] = want if want is not None and want not in new_of.values() else free.pop(0)
        return new_of[old]

    out: Dict[str, Any] = {}
    for name in sorted(names, key=lambda n: (roles[n] not in _FIRST_TOKENS, n)):
        value = _get(default, name)
        ids = value if isinstance(value, list) else [value]
        if ids and all(_int(v) is not None and v >= 0 for v in ids):
            new = [tiny(v, roles[name]) for v in ids]
            out[name] = new if isinstance(value, list) else new[0]
    return out


def build_model(model_type: str, seed: int = 0) -> nn.Module:
    """The type's head model (:func:`architectures`) from :func:`tiny_config`, initialised from
    ``seed``: fp32, train mode, the default attention implementation (``_from_config``, as
    ``AutoModel*.from_config`` calls it, picks sdpa where the class supports it, else eager). A
    head class built on a part of a composite config (a text or decoder config) gets that part."""
    import transformers

    _, _, class_name = architecture(model_type)
    cls = getattr(transformers, class_name)
    cfg = tiny_config(model_type)
    want = getattr(cls, "config_class", None)
    if want is not None and not isinstance(cfg, want):
        parts = [_get(cfg, k) for k in getattr(type(cfg), "sub_configs", None) or {}]
        cfg = next((p for p in parts if isinstance(p, want)), cfg)
    torch.manual_seed(seed)
    return cls._from_config(cfg).float().train()


def make_batch(head: str, seq_len: int = 64, batch: int = 2, seed: int = 0,
               eos: Optional[int] = None) -> Dict[str, Tensor]:
    """The random batch every rank passes whole: ``input_ids`` (B, S) in [LOW_ID, HIGH_ID) (no
    special token), and ``labels``: the ids with ~10% set to -100 (B, S) for a language-model
    head (the model shifts them itself where it is causal), or classes in {0, 1} (B,) for
    sequence classification, whose rows end with ``eos`` as a tokenizer ends them (encoder-decoder
    classifiers read the last eos)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(LOW_ID, HIGH_ID, (batch, seq_len), generator=g)  # (B, S)
    if head == "seq-cls":
        if eos is not None:
            ids[:, -1] = eos
        return {"input_ids": ids, "labels": torch.randint(0, 2, (batch,), generator=g)}  # (B,)
    labels = ids.clone()
    labels[torch.rand(batch, seq_len, generator=g) < 0.1] = -100
    return {"input_ids": ids, "labels": labels}

