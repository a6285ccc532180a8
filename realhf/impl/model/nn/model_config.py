"""`ReaLModelConfig`: the architecture of a ReaLModel, independent of HuggingFace.

One dataclass describes every supported family (llama, qwen2, qwen3, mistral, gpt2, and
the vision-language qwen2_5_vl, whose vision tower is a :class:`VisionConfig`); the
family-specific switches (biases, q/k norm, learned positions, norm type, gated MLP) are
explicit fields, so the model code never branches on the family name.  HuggingFace configs
are converted to and from this class in :mod:`realhf.impl.model.conversion.families`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

from realhf.impl.model.modules.rotary import LLAMA3_ROPE_KEYS

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gpt2", "qwen2_5_vl")
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
SUPPORTED_NORMS = ("rms", "layer")


def _fail(field: str, value: Any, fix: str) -> None:
    raise ValueError(f"ReaLModelConfig.{field}={value!r} is invalid: {fix}")


@dataclasses.dataclass
class VisionConfig:
    """The vision tower of a vision-language model (Qwen2.5-VL's ViT), held in layer 0.

    Images arrive as patches of ``in_channels x temporal_patch_size x patch_size x
    patch_size`` pixels (the HF image processor's ``pixel_values``); blocks are pre-norm
    RMSNorm, bidirectional attention with 2-D RoPE and a gated MLP with biases.  Blocks
    attend within windows of ``window_size`` pixels except those in
    ``fullatt_block_indexes``, which see the whole image.  The merger folds each
    ``spatial_merge_size ** 2`` patches into one token of the language model's width
    ``out_dim``; those tokens replace the ``image_token_id`` placeholders of the prompt.

    Attributes:
        depth, hidden_dim, n_heads, intermediate_dim: the ViT's blocks.
        out_dim: the language model's hidden width (the merger's output).
        image_token_id: the placeholder token an image's features replace.
        vision_start_token_id, vision_end_token_id, video_token_id: the other vision
            tokens of the tokenizer (kept for the HF config; videos are not supported).
        tokens_per_second: HF's temporal position scale (videos only; kept for the config).
    """

    depth: int
    hidden_dim: int
    n_heads: int
    intermediate_dim: int
    out_dim: int
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    video_token_id: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: Tuple[int, ...] = (7, 15, 23, 31)
    activation: str = "silu"
    rope_theta: float = 10000.0
    tokens_per_second: int = 4
    layer_norm_epsilon: float = 1e-6

    def __post_init__(self):
        self.fullatt_block_indexes = tuple(int(i) for i in self.fullatt_block_indexes)
        for name in ("depth", "hidden_dim", "n_heads", "intermediate_dim", "out_dim",
                     "patch_size", "temporal_patch_size", "in_channels", "spatial_merge_size",
                     "window_size"):  # fmt: skip
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(
                    f"VisionConfig.{name}={v!r} is invalid: must be a positive integer"
                )
        if self.hidden_dim % self.n_heads or (self.hidden_dim // self.n_heads) % 4:
            raise ValueError(
                f"VisionConfig: hidden_dim={self.hidden_dim} / n_heads={self.n_heads} must be "
                "a head width divisible by 4 (2-D RoPE rotates half of it per axis)"
            )
        if self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ValueError(
                f"VisionConfig.window_size={self.window_size} must be a multiple of "
                f"patch_size * spatial_merge_size = {self.patch_size * self.spatial_merge_size}"
            )
        if self.activation not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"VisionConfig.activation={self.activation!r}: use one of {SUPPORTED_ACTIVATIONS}"
            )

    @property
    def head_dim(self) -> int:
        """Per-head width of the ViT's attention."""
        return self.hidden_dim // self.n_heads

    @property
    def patch_dim(self) -> int:
        """Pixels of one patch (a row of ``pixel_values``)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches per language-model token."""
        return self.spatial_merge_size**2


@dataclasses.dataclass
class ReaLModelConfig:
    """Architecture of a decoder-only transformer over packed sequences.

    Layer 0 is the token (and, for gpt2, position) embedding, layers
    ``1..n_layers`` are the transformer blocks and layer ``n_layers + 1`` is the
    head (final norm + LM head, or a one-output value head for critics).

    Attributes:
        family: HuggingFace family the weights convert to/from (one of
            ``SUPPORTED_FAMILIES``).
        n_layers: number of transformer blocks.
        hidden_dim: residual stream width.
        n_q_heads: attention query heads.
        n_kv_heads: key/value heads (GQA when smaller than ``n_q_heads``).
        head_dim: per-head width; qwen3 sets it explicitly, otherwise
            ``hidden_dim // n_q_heads``.
        intermediate_dim: MLP inner width.
        vocab_size: embedding rows / LM-head outputs.
        n_positions: maximum position (rope cache / learned position rows).
        rope_theta: RoPE base; unused with ``abs_position_embedding``.
        rope_scaling: None (plain RoPE) or a llama3 scaling: a dict of
            ``rotary.LLAMA3_ROPE_KEYS`` (Llama 3.1/3.2 checkpoints).
        layer_norm_epsilon: epsilon of every norm.
        layer_norm_type: ``"rms"`` (llama-likes) or ``"layer"`` (gpt2).
        activation: MLP activation, one of ``SUPPORTED_ACTIVATIONS``
            (``gelu_tanh`` is gpt2's ``gelu_new``).
        gated_mlp: ``act(gate(x)) * up(x) -> down`` (llama-likes) rather than
            ``fc -> act -> proj`` (gpt2).
        use_attention_bias: bias on the q/k/v projections (qwen2).
        use_attn_proj_bias: bias on the attention output projection.
        use_mlp_bias: bias on the MLP projections (gpt2).
        qk_layernorm: per-head RMSNorm on q and k before RoPE (qwen3).
        tied_embedding: the LM head reuses the token embedding matrix.
        is_critic: the head outputs one value per token instead of logits.
        abs_position_embedding: learned absolute positions (gpt2) instead of
            RoPE.
        sliding_window: attention window in tokens (mistral), ``None`` for
            full causal attention.
        init_std: std of the normal initialisation of fresh weights.
        hf_extra: non-architectural HuggingFace config keys (token ids,
            model-specific flags) kept so that ``save_hf`` writes them back.
        vision: the vision tower of a vision-language model (qwen2_5_vl), else None.
        mrope_section: multimodal RoPE (qwen2_5_vl): the rotary frequency pairs given to
            the temporal, height and width positions, summing to ``head_dim // 2``.  Text
            tokens have three equal positions, so without images it is plain RoPE.
    """

    family: str
    n_layers: int
    hidden_dim: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_dim: int
    vocab_size: int
    n_positions: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, float]] = None
    layer_norm_epsilon: float = 1e-6
    layer_norm_type: str = "rms"
    activation: str = "silu"
    gated_mlp: bool = True
    use_attention_bias: bool = False
    use_attn_proj_bias: bool = False
    use_mlp_bias: bool = False
    qk_layernorm: bool = False
    tied_embedding: bool = False
    is_critic: bool = False
    abs_position_embedding: bool = False
    sliding_window: Optional[int] = None
    init_std: float = 0.02
    hf_extra: Dict[str, Any] = dataclasses.field(default_factory=dict)
    vision: Optional[VisionConfig] = None
    mrope_section: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        if self.family not in SUPPORTED_FAMILIES:
            _fail("family", self.family, f"use one of {SUPPORTED_FAMILIES}")
        for name in (
            "n_layers",
            "hidden_dim",
            "n_q_heads",
            "n_kv_heads",
            "head_dim",
            "intermediate_dim",
            "vocab_size",
            "n_positions",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                _fail(name, v, "must be a positive integer")
        if self.n_q_heads % self.n_kv_heads != 0:
            _fail(
                "n_kv_heads",
                self.n_kv_heads,
                f"must divide n_q_heads={self.n_q_heads} (grouped-query attention)",
            )
        if self.head_dim % 2 != 0 and not self.abs_position_embedding:
            _fail("head_dim", self.head_dim, "RoPE needs an even head_dim")
        if self.activation not in SUPPORTED_ACTIVATIONS:
            _fail("activation", self.activation, f"use one of {SUPPORTED_ACTIVATIONS}")
        if self.layer_norm_type not in SUPPORTED_NORMS:
            _fail("layer_norm_type", self.layer_norm_type, f"use one of {SUPPORTED_NORMS}")
        if not self.layer_norm_epsilon > 0:
            _fail("layer_norm_epsilon", self.layer_norm_epsilon, "must be > 0")
        if not self.abs_position_embedding and not self.rope_theta > 0:
            _fail("rope_theta", self.rope_theta, "must be > 0 for RoPE models")
        if self.rope_scaling is not None:
            keys = set(LLAMA3_ROPE_KEYS)
            if not isinstance(self.rope_scaling, dict) or set(self.rope_scaling) != keys:
                _fail("rope_scaling", self.rope_scaling, f"use None or a dict of {sorted(keys)}")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window <= 0
        ):
            _fail("sliding_window", self.sliding_window, "use a positive int or None")
        if not self.init_std > 0:
            _fail("init_std", self.init_std, "must be > 0")
        if not isinstance(self.hf_extra, dict):
            _fail("hf_extra", self.hf_extra, "must be a dict")
        if isinstance(self.vision, dict):
            self.vision = VisionConfig(**self.vision)
        if self.mrope_section is not None:
            self.mrope_section = tuple(int(x) for x in self.mrope_section)
            if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2:
                _fail(
                    "mrope_section",
                    self.mrope_section,
                    f"give three ints (temporal, height, width) summing to head_dim // 2 = "
                    f"{self.head_dim // 2}",
                )
        if self.vision is not None:
            if self.mrope_section is None:
                _fail("mrope_section", None, "a model with a vision tower needs M-RoPE sections")
            if self.vision.out_dim != self.hidden_dim:
                _fail(
                    "vision.out_dim",
                    self.vision.out_dim,
                    f"must equal hidden_dim={self.hidden_dim}",
                )

    @property
    def max_position_embeddings(self) -> int:
        """HuggingFace's name for ``n_positions``."""
        return self.n_positions

    @property
    def q_dim(self) -> int:
        """Width of the concatenated query heads."""
        return self.n_q_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the concatenated key (or value) heads."""
        return self.n_kv_heads * self.head_dim

    @property
    def head_layer_idx(self) -> int:
        """Index of the head layer (embedding is 0, blocks are 1..n_layers)."""
        return self.n_layers + 1

    @property
    def shares_head_with_embedding(self) -> bool:
        """Whether the LM head uses the embedding matrix (never for critics)."""
        return self.tied_embedding and not self.is_critic

    def same_architecture(self, other: "ReaLModelConfig") -> bool:
        """True when weights of ``other`` fit this model (``hf_extra`` ignored)."""
        a = dataclasses.asdict(self)
        b = dataclasses.asdict(other)
        a.pop("hf_extra")
        b.pop("hf_extra")
        # init_std only shapes fresh weights; loaded ones do not depend on it.
        a.pop("init_std")
        b.pop("init_std")
        return a == b
