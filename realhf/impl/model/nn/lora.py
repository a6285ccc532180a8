"""LoRA adapters on a ReaLModel: train two small matrices per projection, keep one base.

:func:`add_lora` gives a model adapters on the projections named in ``target_modules``
(HuggingFace's names: ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``).  A
target projection ``y = W x`` then computes ``y = W x + (alpha / r) · B A dropout(x)``
with ``A: [r, in]`` (PEFT's initialisation: Kaiming-uniform) and ``B: [out, r]`` (zeros,
so a fresh adapter changes nothing).

The adapters' weights live in a flat buffer of their own (:attr:`LoraWeights.flat`, laid out
like the model's, :mod:`realhf.impl.model.nn.flat_param`), next to the model's: the base
buffer is the untouched checkpoint (frozen: no gradient, no optimizer state, kept in the
compute dtype), and what trains, is saved in a recover checkpoint, or is sent to a
generation server is the adapter buffer alone.  The adapter parameters are not registered
on the model (``model.parameters()`` stays the base's, so everything that walks the base
layout is unchanged); :meth:`~realhf.impl.model.nn.real_model.ReaLModel.trained_parameters`
names what a :class:`~realhf.impl.model.backend.TrainEngine` optimises.

``model.lora.enabled = False`` (or ``with model.lora.disabled():``) runs the base model:
the reference policy of a LoRA actor is the actor with its adapters off, with no second copy
of the weights.

Files: :func:`save_peft` writes PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``, names ``base_model.model.<HF module>.lora_{A,B}.weight``),
which ``peft.PeftModel.from_pretrained`` loads onto the HF base model; :func:`load_peft`
reads it back; :func:`merged` gives the base with ``W + scale · B A`` folded in (for
``save_hf`` of a merged model).

Under tensor parallelism A and B split the way their base weight does: a column-parallel
projection (q, k, v, gate, up) keeps A whole and B by output rows; a row-parallel one
(o, down) splits A by input columns and keeps B whole.  The layers call
:func:`column_delta` / :func:`row_delta`, which apply the tensor-parallel hooks accordingly.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from realhf.api.cli_args import LORA_TARGET_MODULES, LoraConfig
from realhf.impl.model.nn.flat_param import ParamSpec, build_param_spec, flat_view

__all__ = [
    "TARGETS",
    "DEFAULT_TARGETS",
    "LoraSpec",
    "LoraWeights",
    "add_lora",
    "adapter_numel",
    "column_delta",
    "row_delta",
    "save_peft",
    "load_peft",
    "read_peft_spec",
    "is_adapter_dir",
    "adapter_base",
    "merged",
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
]

#: HuggingFace module name -> the module inside one of our blocks
TARGETS = {
    "q_proj": "attn.c_attn.q_attn",
    "k_proj": "attn.c_attn.k_attn",
    "v_proj": "attn.c_attn.v_attn",
    "o_proj": "attn.c_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
assert tuple(TARGETS) == LORA_TARGET_MODULES
DEFAULT_TARGETS = LORA_TARGET_MODULES
#: a LoRA critic's trained copy of its value head: ``{n+1}.value_head.{weight,bias}``
VALUE_HEAD = "value_head"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


#: what adapters a model gets (``actor.lora.*`` in experiment configs): rank, alpha,
#: dropout, target modules; validated where it is made
LoraSpec = LoraConfig


class LoraAdapter:
    """One projection's pair (not a Module: its parameters are not the model's)."""

    __slots__ = ("A", "B", "owner")

    def __init__(self, A: nn.Parameter, B: nn.Parameter, owner: "LoraWeights"):
        self.A, self.B, self.owner = A, B, owner

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        p = self.owner.spec.dropout
        return F.dropout(x, p, training=True) if p > 0 and self.owner.training else x


def column_delta(mod: nn.Module, x: torch.Tensor, tp) -> Optional[torch.Tensor]:
    """The adapter's term of column-parallel projection ``mod`` for its input ``x`` (after
    ``tp.copy_in``), or None (no adapter, or adapters off)."""
    ad: Optional[LoraAdapter] = getattr(mod, "lora", None)
    if ad is None or not ad.owner.enabled:
        return None
    # A is whole on every rank, and each rank's B sees only its output rows: A's gradient
    # is summed over the ranks (the hook for replicated weights used per shard).
    h = F.linear(ad._input(x), tp.head_weight(ad.A))
    return F.linear(h, ad.B) * ad.owner.spec.scale


def row_delta(mod: nn.Module, x: torch.Tensor, tp) -> Optional[torch.Tensor]:
    """The adapter's term of row-parallel projection ``mod`` for its (split) input ``x``,
    summed over the tensor-parallel ranks (add it after ``tp.reduce_out``), or None."""
    ad: Optional[LoraAdapter] = getattr(mod, "lora", None)
    if ad is None or not ad.owner.enabled:
        return None
    # The rank-r product is summed over ranks (it is small), then B (whole) applies to it:
    # B's gradient is then the same on every rank.
    h = tp.reduce_out(F.linear(ad._input(x), ad.A))
    return F.linear(h, ad.B) * ad.owner.spec.scale


class LoraWeights:
    """A model's adapters: their flat buffer, layout, parameters and on/off switch."""

    def __init__(self, spec: LoraSpec, param_spec: Dict[str, ParamSpec], flat: torch.Tensor):
        self.spec = spec
        self.param_spec = param_spec
        self.flat = flat
        self.params: Dict[str, nn.Parameter] = {
            n: nn.Parameter(flat_view(flat, s)) for n, s in param_spec.items()
        }
        #: False: the model runs as its base (the reference policy of a LoRA actor)
        self.enabled = True
        #: dropout applies only while the model is in training mode (set by the model)
        self.training = True

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model for the duration."""
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was

    def use_flat(self, new_flat: torch.Tensor) -> None:
        """Make ``new_flat`` (this layout, any dtype or device) the adapters' buffer."""
        if new_flat.dim() != 1 or new_flat.numel() != self.flat.numel():
            raise ValueError(
                f"an adapter buffer of {self.flat.numel()} elements is needed, got "
                f"{tuple(new_flat.shape)}"
            )
        for n, p in self.params.items():
            p.data = flat_view(new_flat, self.param_spec[n])
        self.flat = new_flat


def all_parameters(model) -> List[Tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of the base and then of the adapters, if any."""
    out = list(model.named_parameters())
    return out if model.lora is None else out + list(model.lora.params.items())


def _whole_shapes(cfg) -> Dict[str, Tuple[int, int]]:
    """``(out, in)`` of each target projection in a model of config ``cfg``."""
    return {
        "q_proj": (cfg.q_dim, cfg.hidden_dim),
        "k_proj": (cfg.kv_dim, cfg.hidden_dim),
        "v_proj": (cfg.kv_dim, cfg.hidden_dim),
        "o_proj": (cfg.hidden_dim, cfg.q_dim),
        "gate_proj": (cfg.intermediate_dim, cfg.hidden_dim),
        "up_proj": (cfg.intermediate_dim, cfg.hidden_dim),
        "down_proj": (cfg.hidden_dim, cfg.intermediate_dim),
    }


def adapter_numel(spec: LoraSpec, cfg) -> int:
    """Elements of the adapters ``spec`` puts on a whole model of config ``cfg`` (a
    critic's value head included)."""
    shapes = _whole_shapes(cfg)
    n = cfg.n_layers * spec.rank * sum(sum(shapes[t]) for t in spec.target_modules)
    return n + (cfg.hidden_dim + 1 if cfg.is_critic else 0)


def _initialise(model, generator: Optional[torch.Generator]) -> None:
    """PEFT's initialisation (A Kaiming-uniform with a = sqrt(5), as nn.Linear; B zero),
    drawn for the whole model in one order and then cut to this rank's part: every layout
    starts from the adapters a single device would draw."""
    cfg, lora = model.config, model.lora
    shapes = _whole_shapes(cfg)
    with torch.no_grad():
        for idx in range(cfg.n_layers, 0, -1):
            for hf in lora.spec.target_modules:
                out_dim, in_dim = shapes[hf]
                bound = 1.0 / math.sqrt(in_dim)
                A = torch.empty(lora.spec.rank, in_dim).uniform_(-bound, bound, generator=generator)
                name = f"{idx}.{TARGETS[hf]}.lora_A"
                if name in lora.params:
                    p = lora.params[name]
                    p.copy_(model.tp.shard_param(name, A, cfg))
                    lora.params[name.replace("lora_A", "lora_B")].zero_()


def _targets(model) -> List[Tuple[int, str, str, nn.Module]]:
    """``(layer index, HF name, our module path, module)`` of every target in the model."""
    spec: LoraSpec = model.lora.spec
    out = []
    for block in model.blocks:
        idx = block.block_idx + 1
        for hf in spec.target_modules:
            mod = block
            for part in TARGETS[hf].split("."):
                mod = getattr(mod, part)
            out.append((idx, hf, TARGETS[hf], mod))
    return out


def add_lora(
    model, spec: LoraSpec, generator: Optional[torch.Generator] = None, init: bool = True
) -> LoraWeights:
    """Give ``model`` (a ReaLModel of a llama-like family) adapters per ``spec``, freshly
    initialised (``init``; else left as allocated, to be loaded); freezes the base weights.
    Returns ``model.lora``."""
    if getattr(model, "lora", None) is not None:
        raise ValueError("this model has LoRA adapters already")
    if not spec.enabled:
        raise ValueError("lora.rank=0 means no adapters; give a positive rank")
    if model.config.family == "gpt2":
        raise ValueError(
            "LoRA adapters are supported on the llama-like families (llama, qwen2, qwen3, "
            "mistral), whose projections are separate; gpt2 fuses q, k and v"
        )
    tp, r = model.tp, spec.rank
    if tp.size > 1 and spec.dropout > 0:
        raise ValueError(
            f"lora.dropout={spec.dropout} under tensor parallelism: the ranks would drop "
            "different inputs of the same projection; use lora.dropout=0"
        )
    if tp.size > model.config.n_kv_heads and {"k_proj", "v_proj"} & set(spec.target_modules):
        raise ValueError(
            f"LoRA on k_proj/v_proj with {tp.size} tensor-parallel ranks and "
            f"{model.config.n_kv_heads} key/value heads (ranks would share copies of a head): "
            "leave k_proj and v_proj out of lora.target_modules, or use fewer ranks"
        )
    # Local shapes (this rank's shard under tensor parallelism): out, in of each target.
    shapes = _whole_shapes(model.layer_config)
    layers = []
    for block in model.blocks:
        decls = []
        for hf in spec.target_modules:
            out_dim, in_dim = shapes[hf]
            decls.append((f"{TARGETS[hf]}.lora_A", (r, in_dim)))
            decls.append((f"{TARGETS[hf]}.lora_B", (out_dim, r)))
        layers.append((block.block_idx + 1, decls))
    head = model.config.head_layer_idx
    if model.config.is_critic and model.has_head:  # the value head trains whole, as a copy
        layers.append((head, [(VALUE_HEAD + ".weight", (1, model.config.hidden_dim))]))
        layers[-1][1].append((VALUE_HEAD + ".bias", (1,)))
    param_spec, total = build_param_spec(layers)
    flat = torch.empty(total, dtype=model.dtype, device=model.device)
    model.lora = lora = LoraWeights(spec, param_spec, flat)
    lora.training = model.training
    for idx, _, path, mod in _targets(model):
        A = lora.params[f"{idx}.{path}.lora_A"]
        B = lora.params[f"{idx}.{path}.lora_B"]
        mod.lora = LoraAdapter(A, B, lora)
    if f"{head}.{VALUE_HEAD}.weight" in lora.params:
        w, b = (lora.params[f"{head}.{VALUE_HEAD}.{n}"] for n in ("weight", "bias"))
        model.head.lora_value = (w, b)
        with torch.no_grad():  # from the model's own (loaded or fresh) value head
            w.copy_(model.head.weight)
            b.copy_(model.head.bias)
    if init:
        _initialise(model, generator)
    for p in model.parameters():
        p.requires_grad_(False)
    return lora


# ---------------------------------------------------------------- files (PEFT's format)


def _hf_module_names(model) -> Dict[str, str]:
    """Our adapter-parameter prefix (``3.attn.c_attn.q_attn``) -> PEFT's key prefix."""
    from realhf.impl.model.conversion.families import get_family

    cfg = model.config
    fam = get_family(cfg.family)
    rules = {r.ours[0]: r for r in fam.weight_rules(cfg) if len(r.ours) == 1}
    out = {}
    for idx, _, path, _ in _targets(model):
        rule = rules.get(f"{idx}.{path}.weight")
        if rule is None or rule.kind != "copy":
            raise ValueError(f"no HuggingFace name for {idx}.{path}.weight in this family")
        out[f"{idx}.{path}"] = _PEFT_PREFIX + fam.peft_module(rule.hf_name.removesuffix(".weight"))
    return out


def _critic_head_name(model) -> str:
    from realhf.impl.model.conversion.families import get_family

    return get_family(model.config.family).critic_head


def _value_head(model) -> Dict[str, str]:
    """A LoRA critic's trained value head: our parameter name -> PEFT's key ({} if none)."""
    head = model.config.head_layer_idx
    if f"{head}.{VALUE_HEAD}.weight" not in model.lora.params:
        return {}
    hf = _PEFT_PREFIX + _critic_head_name(model)
    return {f"{head}.{VALUE_HEAD}.{n}": f"{hf}.{n}" for n in ("weight", "bias")}


def _whole(model) -> None:
    if getattr(model.tp, "distributed", False) or model.layer_range != (
        0,
        model.config.n_layers + 2,
    ):
        raise NotImplementedError(
            "saving or loading adapter files needs the whole single-device model "
            "(gather a tensor- or pipeline-parallel one first)"
        )


def save_peft(model, out_dir: str, base_model_path: Optional[str] = None) -> None:
    """Write ``model``'s adapters as a PEFT LoRA adapter directory."""
    from safetensors.torch import save_file

    _whole(model)
    lora: LoraWeights = model.lora
    names = _hf_module_names(model)
    tensors = {}
    for ours, theirs in names.items():
        for m in ("lora_A", "lora_B"):
            tensors[f"{theirs}.{m}.weight"] = lora.params[f"{ours}.{m}"].detach().cpu().clone()
    score = _value_head(model)
    for ours, theirs in score.items():
        tensors[theirs] = lora.params[ours].detach().cpu().clone()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    s = lora.spec
    config = {
        "peft_type": "LORA",
        "task_type": "TOKEN_CLS" if score else "CAUSAL_LM",
        "base_model_name_or_path": base_model_path,
        "r": s.rank,
        "lora_alpha": s.alpha,
        "lora_dropout": s.dropout,
        "target_modules": sorted(s.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": [_critic_head_name(model)] if score else None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    from realhf.impl.model.conversion.families import get_family

    exclude = get_family(model.config.family).peft_exclude
    if exclude is not None:  # (a vision tower's MLP names match the target list too)
        config["exclude_modules"] = exclude
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)


def is_adapter_dir(path) -> bool:
    """Whether ``path`` is a PEFT adapter directory (not a whole HF model)."""
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG)) and not os.path.isfile(
        os.path.join(path, "config.json")
    )


def adapter_base(adapter_dir) -> str:
    """The base model directory an adapter directory names (``base_model_name_or_path``;
    relative to the adapter directory if relative)."""
    with open(os.path.join(adapter_dir, ADAPTER_CONFIG)) as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ValueError(
            f"{adapter_dir}: {ADAPTER_CONFIG} names no base_model_name_or_path; load the base "
            "model and then the adapter (load_peft)"
        )
    path = os.path.join(str(adapter_dir), base)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{adapter_dir}: its base model {base!r} is not a directory here (models are "
            "not downloaded); copy the base model there or edit base_model_name_or_path"
        )
    return path


def read_peft_spec(adapter_dir: str) -> LoraSpec:
    """The :class:`LoraSpec` of a PEFT adapter directory (LoRA, no per-module ranks)."""
    path = os.path.join(adapter_dir, ADAPTER_CONFIG)
    try:
        with open(path) as f:
            c = json.load(f)
    except OSError as e:
        raise FileNotFoundError(f"no LoRA adapter at {adapter_dir!r}: {e}") from None
    if c.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type={c.get('peft_type')!r}; only LORA adapters load")
    for key in ("rank_pattern", "alpha_pattern"):
        if c.get(key):
            raise ValueError(f"{path}: {key} is not supported (one rank and alpha for all)")
    for key in ("use_rslora", "use_dora"):
        if c.get(key):
            raise ValueError(f"{path}: {key}=true is not supported")
    extra = [m for m in c.get("modules_to_save") or () if m not in ("score", "classifier")]
    if extra:
        raise ValueError(
            f"{path}: modules_to_save {extra} are not supported (a critic's value head is)"
        )
    targets = c.get("target_modules")
    if isinstance(targets, str):
        raise ValueError(f"{path}: a regex target_modules is not supported; list the modules")
    # (exclude_modules keeps PEFT off a vision tower, which our adapters never touch)
    if not isinstance(c.get("exclude_modules"), (str, list, type(None))):
        raise ValueError(f"{path}: exclude_modules must be a regex, a list or null")
    return LoraSpec(
        int(c["r"]), float(c["lora_alpha"]), float(c.get("lora_dropout", 0.0)), list(targets)
    )


def load_peft(model, adapter_dir: str) -> None:
    """Load a PEFT adapter directory into ``model``'s adapters (which must match it); a
    part of a parallel layout takes its shard of them."""
    from safetensors.torch import load_file

    spec = read_peft_spec(adapter_dir)
    mine = model.lora.spec
    if (spec.rank, spec.alpha, spec.target_modules) != (
        mine.rank,
        mine.alpha,
        mine.target_modules,
    ):
        raise ValueError(
            f"the adapter at {adapter_dir!r} has rank {spec.rank}, alpha {spec.alpha:g} on "
            f"{list(spec.target_modules)}; this model's: rank {mine.rank}, alpha "
            f"{mine.alpha:g} on {list(mine.target_modules)}"
        )
    tensors = load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
    lora: LoraWeights = model.lora
    with torch.no_grad():
        for ours, theirs in _hf_module_names(model).items():
            for m in ("lora_A", "lora_B"):
                key, name = f"{theirs}.{m}.weight", f"{ours}.{m}"
                if key not in tensors:
                    raise KeyError(f"{adapter_dir}: {ADAPTER_WEIGHTS} lacks {key}")
                lora.params[name].copy_(model.tp.shard_param(name, tensors[key], model.config))
        for ours, theirs in _value_head(model).items():
            if theirs not in tensors:
                raise KeyError(
                    f"{adapter_dir}: {ADAPTER_WEIGHTS} lacks {theirs} (a critic's adapter "
                    "holds its value head)"
                )
            lora.params[ours].copy_(tensors[theirs])


def merged(model):
    """A copy of ``model`` without adapters whose weights have them folded in
    (``W + scale · B A``; what a merged ``save_hf`` writes)."""
    out = model.copy_base()
    lora: LoraWeights = model.lora
    params = dict(out.named_parameters())
    with torch.no_grad():
        for ours in _value_head(model):
            params[ours.replace(f".{VALUE_HEAD}", "")].copy_(lora.params[ours])
        for idx, _, path, _ in _targets(model):
            A = lora.params[f"{idx}.{path}.lora_A"].float()
            B = lora.params[f"{idx}.{path}.lora_B"].float()
            w = params[f"{idx}.{path}.weight"]
            w.copy_(w.float() + lora.spec.scale * (B @ A))
    return out
