"""Registry of the HuggingFace families ReaLModel converts to and from.

Each :class:`HFFamily` names the HF ``model_type``, the architecture classes a
causal LM and a critic are saved as, and the module holding the config and
weight conversion (``config_from_hf``, ``config_to_hf``,
``check_representable``, ``weight_rules``).

Critics are saved as ``*ForTokenClassification`` with ``num_labels=1`` — the
value head is then HF's ``score`` (``classifier`` for gpt2) linear layer with a
bias, so ``transformers.AutoModelForTokenClassification`` computes the same
per-token values.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any, Dict, List, Optional

from realhf.impl.model.conversion import gpt2, llama_like, qwen2_5_vl
from realhf.impl.model.conversion.hf_config import UnsupportedCheckpoint
from realhf.impl.model.conversion.rules import WeightRule, copy_rule
from realhf.impl.model.nn.model_config import ReaLModelConfig


@dataclasses.dataclass(frozen=True)
class HFFamily:
    """How one family is named and converted."""

    name: str
    model_type: str
    causal_arch: str
    critic_arch: str
    critic_head: str
    converter: ModuleType

    def config_from_hf(self, hf, source: str, is_critic: bool) -> ReaLModelConfig:
        """Our config from a transformers config object."""
        cfg = self.converter.config_from_hf(self.name, hf, source)
        return dataclasses.replace(cfg, is_critic=is_critic)

    def config_to_hf_kwargs(self, cfg: ReaLModelConfig) -> Dict[str, Any]:
        """Keyword arguments for the transformers config class (architecture set)."""
        self.converter.check_representable(cfg)
        kw = self.converter.config_to_hf(cfg)
        kw.update(cfg.hf_extra)  # the source checkpoint's token ids and flags, as read
        if cfg.is_critic:
            kw["architectures"] = [self.critic_arch]
            kw["num_labels"] = 1
        else:
            kw["architectures"] = [self.causal_arch]
        return kw

    def peft_module(self, hf_name: str) -> str:
        """The transformers module path (PEFT's adapter names) of checkpoint name
        ``hf_name``; the same for every family but those whose model nests differently."""
        return getattr(self.converter, "peft_module", lambda n: n)(hf_name)

    @property
    def peft_exclude(self) -> Optional[str]:
        """PEFT's ``exclude_modules`` (a regex) for adapters of this family, or None."""
        return getattr(self.converter, "PEFT_EXCLUDE", None)

    def weight_rules(self, cfg: ReaLModelConfig) -> List[WeightRule]:
        """All rules for ``cfg``, including the critic's value head."""
        rules = list(self.converter.weight_rules(cfg))
        if cfg.is_critic:
            rules += self.critic_head_rules(cfg)
        return rules

    def critic_head_rules(self, cfg: ReaLModelConfig) -> List[WeightRule]:
        """Rules for the value head ``{n+1}.weight [1, H]`` and ``{n+1}.bias [1]``."""
        head = cfg.head_layer_idx
        return [
            copy_rule(f"{self.critic_head}.weight", f"{head}.weight", (1, cfg.hidden_dim)),
            copy_rule(f"{self.critic_head}.bias", f"{head}.bias", (1,)),
        ]


_ALL = [
    HFFamily(
        "llama", "llama", "LlamaForCausalLM", "LlamaForTokenClassification", "score", llama_like
    ),
    HFFamily(
        "qwen2", "qwen2", "Qwen2ForCausalLM", "Qwen2ForTokenClassification", "score", llama_like
    ),
    HFFamily(
        "qwen3", "qwen3", "Qwen3ForCausalLM", "Qwen3ForTokenClassification", "score", llama_like
    ),
    HFFamily(
        "mistral",
        "mistral",
        "MistralForCausalLM",
        "MistralForTokenClassification",
        "score",
        llama_like,
    ),
    HFFamily("gpt2", "gpt2", "GPT2LMHeadModel", "GPT2ForTokenClassification", "classifier", gpt2),
    # (no token-classification class exists: qwen2_5_vl.check_representable refuses critics)
    HFFamily(
        "qwen2_5_vl",
        "qwen2_5_vl",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLForTokenClassification",
        "score",
        qwen2_5_vl,
    ),
]
FAMILIES: Dict[str, HFFamily] = {f.name: f for f in _ALL}
_BY_MODEL_TYPE = {f.model_type: f for f in _ALL}


def get_family(name: str) -> HFFamily:
    """The family called ``name`` (our ``ReaLModelConfig.family``)."""
    if name not in FAMILIES:
        raise UnsupportedCheckpoint(
            f"family {name!r} is not supported; use one of {sorted(FAMILIES)}"
        )
    return FAMILIES[name]


def family_of_hf_config(raw: Dict[str, Any], source: str) -> HFFamily:
    """Pick the family from a config.json dict (``model_type``, else ``architectures``)."""
    model_type: Optional[str] = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    if model_type is None:
        for f in _ALL:
            if f.causal_arch in archs or f.critic_arch in archs:
                return f
    raise UnsupportedCheckpoint(
        f"{source}: model_type={model_type!r} (architectures={archs}) is not supported by "
        f"ReaLModel; supported model_type values: {sorted(_BY_MODEL_TYPE)}"
    )
