import pathlib

import torch
from tiny_models import make_tiny_hf_model
from transformers import AutoTokenizer

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.api.core.model_api import Model
from realhf.api.core.registry import make_interface
from realhf.impl.model import ReaLModel

ASSETS = pathlib.Path(__file__).resolve().parents[4] / "realhf" / "assets" / "tiny"


def test_greedy_accuracy_is_graded(tmp_path):
    import realhf.impl.model.interface.math_eval_interface  # noqa: F401  (registers)

    tok = AutoTokenizer.from_pretrained(ASSETS)
    d = make_tiny_hf_model("qwen2", tmp_path / "m", vocab_size=len(tok), tie_word_embeddings=True)
    net = ReaLModel.from_hf(d)
    prompts = [tok("Compute 1+1.", add_special_tokens=False)["input_ids"]] * 2
    data = SequenceSample.from_default(
        ids=["a", "b"],
        seqlens=[len(p) for p in prompts],
        data={"packed_prompts": torch.tensor(sum(prompts, []))},
        metadata={"solutions": [["\\boxed{2}"], ["\\boxed{3}"]]},
    )
    iface = make_interface("math_eval", max_new_tokens=4)
    model = Model(name="actor", module=net, tokenizer=tok, device="cpu")
    out = iface.evaluate(model, data, MicroBatchSpec())
    # greedy answers of both items are identical (same prompt); the random model cannot
    # produce a boxed answer in 4 tokens, so both are wrong and each answer has 4 tokens or
    # stopped early at EOS
    assert out["eval/greedy_acc"] == 0.0
    assert 0 < out["eval/mean_len"] <= 4
