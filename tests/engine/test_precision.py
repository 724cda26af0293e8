"""Low-precision models compute the final norm and the vocabulary projection in fp32."""

import torch


def test_bf16_model_gives_fp32_logits_close_to_the_fp32_model(tiny):
    target = tiny.tiny_vocab_target(vocab_size=64)
    tokens = torch.tensor([[1, 5, 9, 3, 7]])
    pos = torch.arange(5)[None]
    ref = target(tokens, pos)
    low = target.to(torch.bfloat16)
    out = low(tokens, pos)
    assert out.logits.dtype == torch.float32
    assert out.final_hidden.dtype == torch.bfloat16
    assert torch.allclose(out.logits, ref.logits, atol=0.15), (out.logits - ref.logits).abs().max()
    # The fp32 projection follows the weights it was made from (re-made if the module moves).
    assert low._lm_head_fp32().dtype == torch.float32
