"""``safe_zero.accelerate.allow_trainer_fine_tuning``: transformers' refusal to fine-tune FP-Quant, lifted per model.

``Trainer.__init__`` (and so TRL's ``SFTTrainer``) calls ``validate_quantization_for_training``; these
tests call it directly on a tiny Llama carrying an FP-Quant quantizer without master weights, as
``from_pretrained`` leaves it. A real FP-Quant checkpoint through HF Trainer and ``SFTTrainer`` is in
``tests/examples/test_examples.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "FPQuantConfig"):  # FP-Quant arrived in a transformers release above safe_zero's floor
    pytest.skip(f"transformers {transformers.__version__} has no FP-Quant integration", allow_module_level=True)

from transformers import FPQuantConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.quantizers.quantizer_fp_quant import FPQuantHfQuantizer  # noqa: E402
from transformers.trainer_utils import validate_quantization_for_training  # noqa: E402

from safe_zero import SafeZeroError  # noqa: E402
from safe_zero.accelerate import allow_trainer_fine_tuning  # noqa: E402

REFUSAL = "quantized with QuantizationMethod.FPQUANT but that quantization method do not support training"


def quantized_llama() -> LlamaForCausalLM:
    """A tiny Llama with the quantizer and the flag ``from_pretrained(..., quantization_config=FPQuantConfig(...))``
    sets."""
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.hf_quantizer = FPQuantHfQuantizer(FPQuantConfig(pseudoquantization=True, store_master_weights=False))
    model.is_quantized = True
    return model


def test_lifts_the_refusal_for_that_model_only():
    model, other = quantized_llama(), quantized_llama()
    with pytest.raises(ValueError, match=REFUSAL):
        validate_quantization_for_training(model)

    assert allow_trainer_fine_tuning(model) is model
    validate_quantization_for_training(model)  # accepted now
    quantizer = model.hf_quantizer
    assert isinstance(quantizer, FPQuantHfQuantizer) and quantizer.is_trainable is True
    assert quantizer.quantization_config.store_master_weights is False, "the model's configuration is unchanged"

    # transformers' class and every other model are untouched.
    with pytest.raises(ValueError, match=REFUSAL):
        validate_quantization_for_training(other)
    assert type(other.hf_quantizer) is FPQuantHfQuantizer


def test_is_idempotent_and_shares_one_subclass():
    first, second = quantized_llama(), quantized_llama()
    allow_trainer_fine_tuning(first)
    twin = type(first.hf_quantizer)
    allow_trainer_fine_tuning(first)
    allow_trainer_fine_tuning(second)
    assert type(first.hf_quantizer) is twin and type(second.hf_quantizer) is twin
    assert twin.__mro__[1] is FPQuantHfQuantizer, "no subclass of a subclass"


def test_works_through_a_peft_model():
    peft = pytest.importorskip("peft")
    model = quantized_llama()
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match=REFUSAL):
        validate_quantization_for_training(wrapped)
    assert allow_trainer_fine_tuning(wrapped) is wrapped
    validate_quantization_for_training(wrapped)
    assert model.hf_quantizer.is_trainable is True


def test_refuses_a_model_that_is_not_quantized():
    plain = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(SafeZeroError, match="has no hf_quantizer, so it is not a quantized transformers model"):
        allow_trainer_fine_tuning(plain)


def test_import_stays_lazy():
    """``import safe_zero.accelerate`` imports no transformers: the Trainer glue is imported when first named."""
    code = "import sys, safe_zero.accelerate; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
